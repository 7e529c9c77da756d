"""When a worker may dispatch a program that meets other devices in collectives.

`CollectiveOrder`, a part of `DeviceHost` (`host.collectives`), says which programs span
devices of other hosts, fails the outputs of one that would wait for a lost peer, and keeps
the two rules that hold back the next collective program (a few at a time over several local
CPU devices; nothing new on a communicator whose last collective failed).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import cast

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray, ShardedToken
from isthmus.ids import BufferId, ExecutableId
from isthmus.worker.colocated import Program
from isthmus.worker.slots import Loaded, Settling, Unloadable, block_all, first_of

logger = logging.getLogger(__name__)


class CollectiveOrder:
    """A host's collective programs in flight, and the rules of the next one's dispatch.
    It is handed the host's program table and thread pool (shared, not copied), whether
    the host's devices meet on a shared thread pool (XLA:CPU), and how to fail a buffer."""

    # Collective programs over several local CPU devices a worker keeps in flight (see
    # `settled`): 2 lets the next step be dispatched while one runs, so the
    # devices never wait for the worker to notice a step's end (8% more steps/s on
    # bench/dp_loop.py, bench/RESULTS.md), and stays far from the deadlock of many.
    CPU_COLLECTIVES_IN_FLIGHT = 2

    def __init__(self, executables: dict[ExecutableId, Program],
                 pool: concurrent.futures.Executor, shared_pool: bool,
                 fail: Callable[[BufferId, errors.IsthmusError], None]) -> None:
        self._executables = executables
        self._pool = pool
        self._shared_pool = shared_pool
        self._fail = fail
        self.in_flight: collections.deque[InFlight] = collections.deque()  # oldest first
        self.failed = False  # one that finished since the last dispatch failed

    def spans_any(self, executable_id: ExecutableId, device_ids: frozenset[int]) -> bool:
        """The program runs on some of these devices of other hosts."""
        loaded = self._executables.get(executable_id)
        return (isinstance(loaded, Loaded) and loaded.span is not None
                and not loaded.span.isdisjoint(device_ids))

    def fail_outputs(self, executable_id: ExecutableId, results: Sequence[int],
                     error: errors.IsthmusError) -> None:
        """Makes this host's outputs of one run of a program error buffers."""
        # An Execute names a compiled program (colocated functions run by `python_calls`).
        loaded = cast("Loaded | Unloadable | None", self._executables.get(executable_id))
        for base in results:
            for p in loaded.positions if loaded is not None else ():
                self._fail(BufferId(base + p), error)

    def spans_others(self, executable_id: ExecutableId) -> bool:
        """The program runs on devices of other hosts too: their parts meet this host's."""
        loaded = self._executables.get(executable_id)
        return isinstance(loaded, Loaded) and loaded.span is not None

    def is_collective(self, executable_id: ExecutableId) -> bool:
        """The program runs on several devices of this host, or on devices of other hosts
        too: it may meet them in collectives."""
        loaded = self._executables.get(executable_id)
        return isinstance(loaded, Loaded) and (
            len(loaded.positions) > 1 or loaded.span is not None)

    async def settled(self, executable_id: ExecutableId,
                                 superseded: asyncio.Event) -> None:
        """Called before dispatching a collective program: waits for the last one, when
        that is needed, and holds back after one that failed.

        *A few at a time over several local devices (CPU).* XLA:CPU runs the devices of a
        program on a shared thread pool and meets them in an in-process rendezvous for
        collectives; with many such programs in flight on few cores, the pool fills with
        devices of later steps waiting for devices that cannot get a thread, and every step
        hangs (local jax too). So before a program over several devices of this host, all
        but CPU_COLLECTIVES_IN_FLIGHT - 1 of the collective programs before it must have
        finished; the worker's backlog then slows the client through flow control instead.
        GPU devices run on streams of their own and keep many steps in flight (their hosts'
        colocated CPU devices do not).

        *Nothing new on a broken communicator.* When a collective program before it failed
        (a peer died mid-step), the peer's half-consumed messages still sit in gloo's
        sockets, and a new collective on the same communicator would read them as its own
        and abort the process. So after a failure this waits for the group to re-form
        (`superseded`), for at most HOLD_AFTER_FAILURE seconds (a program's own runtime
        error must not stall the worker for long). A program dispatched while the failing
        one still ran reads that one's outputs (a training step reads the last step's
        parameters) and fails with them, without meeting its peers.

        Once `superseded` is set (the group is being replaced; a computation may wait for
        a lost peer forever) nothing waits.
        """
        in_flight = self.in_flight
        if not in_flight and not self.failed:
            return
        if superseded.is_set():
            in_flight.clear()
            self.failed = False
            return
        oldest = self.backlog(executable_id)
        if oldest:
            await first_of(superseded, self.wait_for(oldest))
        self.drop_finished()
        failed, self.failed = self.failed, False
        if failed and not superseded.is_set():
            in_flight.clear()
            logger.info("a collective program failed; waiting up to %.0f s for the group "
                        "to re-form before the next one", self.HOLD_AFTER_FAILURE)
            await first_of(superseded, asyncio.sleep(self.HOLD_AFTER_FAILURE))

    def backlog(self, executable_id: ExecutableId) -> list[InFlight]:
        """What a program must wait for before it is dispatched (the first rule of
        `settled`, and all the embedded backend keeps, having no peers): the
        output shards of the oldest collective programs in flight when it runs over several
        local CPU devices and more than CPU_COLLECTIVES_IN_FLIGHT - 1 are; [] when it may
        go now."""
        in_flight = self.in_flight
        if not in_flight:
            return []
        loaded = self._executables.get(executable_id)
        if not (isinstance(loaded, Loaded) and len(loaded.positions) > 1
                and (self._shared_pool or loaded.devices[0].platform == "cpu")):
            return []
        self.drop_finished()
        room = self.CPU_COLLECTIVES_IN_FLIGHT - 1
        return list(in_flight)[:max(0, len(in_flight) - room)]

    def wait_for(self, values: Sequence[Settling]) -> asyncio.Future[None]:
        """Resolves once these arrays or programs in flight are computed or donated (waited
        for in a thread)."""
        return asyncio.get_running_loop().run_in_executor(self._pool, block_all, values)

    def started(self, outputs: list[JaxArray], token: ShardedToken | None = None) -> None:
        """A collective program was dispatched: these are its output shards, and `token`
        (jaxlib's `ShardedToken` of the run, if asked for) tells when it ends."""
        self.in_flight.append(InFlight(outputs, token))
        if len(self.in_flight) > 1:
            self.drop_finished()  # what a GPU's queue finished lets go of memory

    def drop_finished(self) -> None:
        """Drops the programs in flight that have finished, oldest first, noting a
        failure."""
        in_flight = self.in_flight
        while in_flight and in_flight[0].finished():
            if in_flight.popleft().failed():
                self.failed = True

    HOLD_AFTER_FAILURE = 3.0  # seconds: the controller re-forms within ~0.5 s of a loss


class InFlight:
    """A collective program in flight, known by its output shards and the token of its run.

    Its outputs answer without blocking whether it has finished, until a later program
    takes one by donation (a training step donates the last step's parameters): jaxlib then
    marks the shard deleted, and a deleted array can no longer be asked whether it is
    ready. Its other outputs still answer; when all were donated, the program is known to
    have finished only once its token was waited for (`block_until_ready`, in a thread).
    Counting it finished then would let a loop that donates everything it returns run
    away: each step would leave the count as soon as the next was dispatched, and hundreds
    in flight deadlock XLA:CPU's pool (local jax's too).
    (Only donation deletes a worker's arrays: `BufferStore.free` drops references.)
    """

    __slots__ = ("outputs", "token", "_done", "_error")

    def __init__(self, outputs: list[JaxArray], token: ShardedToken | None) -> None:
        self.outputs = outputs
        self.token = token
        self._done = False  # the token (or every output) was waited for
        self._error = False  # ... and the run failed

    def finished(self) -> bool:
        """Known to have ended, without blocking: its outputs not donated are computed (they
        are made together), or, all donated, its token was waited for."""
        if self._done:
            return True
        kept = False
        for value in self.outputs:
            if value.is_deleted():
                continue
            if not value.is_ready():
                return False
            kept = True
        return kept or self.token is None

    def block_until_ready(self) -> None:
        """Waits for the program to end (in a thread; `block_all` calls it): for its
        outputs, or, when all of them were donated, for its token."""
        block_all(self.outputs)
        if self.token is not None and all(value.is_deleted() for value in self.outputs):
            try:
                self.token.block_until_ready()
            except Exception:  # noqa: BLE001 - read by `failed`
                self._error = True
        self._done = True

    def is_deleted(self) -> bool:  # as an array `block_all` passes over
        return False

    def failed(self) -> bool:
        """Some shard of this finished program holds an error, or its run failed."""
        return self._error or failed(self.outputs)


def failed(values: list[JaxArray]) -> bool:
    """Some of these settled shards hold an error (donated ones are their consumer's)."""
    for value in values:
        if value.is_deleted():
            continue
        try:
            value.block_until_ready()
        except Exception:  # noqa: BLE001 - the error itself is reported where it is used
            if value.is_deleted():  # donated meanwhile
                continue
            return True
    return False
