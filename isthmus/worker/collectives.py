"""When a worker may dispatch a program that meets other devices in collectives.

`DeviceHost` takes these from `CollectiveOrder`: which programs span devices of other hosts,
failing the outputs of one that would wait for a lost peer, and the two rules that hold back
the next collective program (one at a time over several local CPU devices; nothing new on a
communicator whose last collective failed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from isthmus import errors
from isthmus.ids import BufferId, ExecutableId
from isthmus.worker.slots import Loaded, any_failed, block_all, first_of

logger = logging.getLogger(__name__)


class CollectiveOrder:
    """Mixed into `DeviceHost`, whose `_executables`, `_last_collective`, `_shared_pool`,
    `_pool` and `fail` it uses."""

    _executables: dict[ExecutableId, Any]
    _last_collective: list[Any]
    _shared_pool: bool
    _pool: Any
    fail: Any  # DeviceHost.fail

    def spans_any(self, executable_id: ExecutableId, device_ids: frozenset[int]) -> bool:
        """The program runs on some of these devices of other hosts."""
        loaded = self._executables.get(executable_id)
        return (isinstance(loaded, Loaded) and loaded.span is not None
                and not loaded.span.isdisjoint(device_ids))

    def fail_outputs(self, executable_id: ExecutableId, results: Sequence[int],
                     error: errors.IsthmusError) -> None:
        """Makes this host's outputs of one run of a program error buffers."""
        loaded = self._executables.get(executable_id)
        for base in results:
            for p in loaded.positions if loaded is not None else ():
                self.fail(BufferId(base + p), error)

    def is_collective(self, executable_id: ExecutableId) -> bool:
        """The program runs on several devices of this host, or on devices of other hosts
        too: it may meet them in collectives."""
        loaded = self._executables.get(executable_id)
        return isinstance(loaded, Loaded) and (
            len(loaded.positions) > 1 or loaded.span is not None)

    async def collective_settled(self, executable_id: ExecutableId,
                                 superseded: asyncio.Event) -> None:
        """Called before dispatching a collective program: waits for the last one, when
        that is needed, and holds back after one that failed.

        *One at a time over several local devices (CPU).* XLA:CPU runs the devices of a program
        on a shared thread pool and meets them in an in-process rendezvous for collectives;
        with many such programs in flight on few cores, the pool fills with devices of
        later steps waiting for devices that cannot get a thread, and every step hangs. So
        before a program over several devices of this host, the last collective program
        must have finished; the worker's backlog then slows the client through flow
        control instead. GPU devices run on streams of their own and keep many steps in
        flight (their hosts' colocated CPU devices do not).

        *Nothing new on a broken communicator.* When the last collective program failed
        (a peer died mid-step), the peer's half-consumed messages still sit in gloo's
        sockets, and a new collective on the same communicator would read them as its own
        and abort the process. So after a failure this waits for the group to re-form
        (`superseded`), for at most HOLD_AFTER_FAILURE seconds (a program's own runtime
        error must not stall the worker for long).

        Once `superseded` is set (the group is being replaced; a computation may wait for
        a lost peer forever) nothing waits.
        """
        values, self._last_collective = self._last_collective, []
        if not values or superseded.is_set():
            return
        loaded = self._executables.get(executable_id)
        local = (isinstance(loaded, Loaded) and len(loaded.positions) > 1
                 and (self._shared_pool or loaded.devices[0].platform == "cpu"))
        pending = [v for v in values if not v.is_ready()]
        if pending and local:
            await first_of(superseded, asyncio.get_running_loop().run_in_executor(
                self._pool, block_all, pending))
            pending = [v for v in values if not v.is_ready()]
        if not pending and not superseded.is_set() and any_failed(values):
            logger.info("a collective program failed; waiting up to %.0f s for the group "
                        "to re-form before the next one", self.HOLD_AFTER_FAILURE)
            await first_of(superseded, asyncio.sleep(self.HOLD_AFTER_FAILURE))

    HOLD_AFTER_FAILURE = 3.0  # seconds: the controller re-forms within ~0.5 s of a loss
