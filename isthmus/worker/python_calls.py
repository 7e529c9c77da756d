"""Colocated Python calls on a `DeviceHost` (its `python` part): loading programs, running
calls in order per stream and concurrently across streams, and storing their outputs
(`colocated.py` has the model)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TypeAlias

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray, JaxlibDevice
from isthmus.ids import BufferId, ExecutableId
from isthmus.transport import records
from isthmus.worker import colocated, regroup
from isthmus.worker.buffers import BufferStore, ids_of
from isthmus.worker.slots import Failed, HostArray, Slot, Unloadable, failing

# A colocated call's outputs on this host: per output, the values of its local positions.
Outputs: TypeAlias = list[list[JaxArray | HostArray]]


class PythonCalls:
    """A host's colocated Python calls, a part of `DeviceHost` over its buffers, devices,
    programs and thread pool (shared with it, not copied): loading programs, running calls
    in order per stream and concurrently across streams, and storing their outputs."""

    def __init__(self, buffers: BufferStore, devices: dict[int, JaxlibDevice],
                 local: set[JaxlibDevice], executables: dict[ExecutableId, colocated.Program],
                 pool: concurrent.futures.Executor) -> None:
        self.buffers = buffers
        self.devices = devices  # by global id
        self._local = local  # those held here
        self._executables = executables  # the host's programs, colocated ones among them
        self._pool = pool
        self._runner: PythonRunner | None = None  # made at the first call

    async def load(self, executable_id: ExecutableId,
                   program: records.ColocatedProgram) -> None:
        try:
            function = await asyncio.get_running_loop().run_in_executor(
                self._pool, colocated.load, program, self.devices, self._local)
        except errors.IsthmusError as e:
            self._executables[executable_id] = Unloadable(e, ())
            raise
        self._executables[executable_id] = function

    def drop(self, dropped: colocated.Program | None) -> None:
        """A program the host dropped: a Python function is kept while calls may need it."""
        if isinstance(dropped, colocated.PythonFunction) and self._runner is not None:
            # Calls submitted before the drop may not have started yet, and they may need
            # what this function holds (a colocated object's first method call finds the
            # object through the function that made it): let them run first.
            self._runner.keep_while_busy(dropped)

    def call(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
             results: Sequence[int], stream: tuple[int, ...] | None = None
             ) -> Awaitable[None]:
        """Runs a colocated Python function on this host's shards (`colocated.py`).

        `args[i]` names input i's shards in the order of its own devices (a group base or one
        id per position), `results[j]` is output j's group base. Resolves when the outputs
        are stored, or fails with the function's error (which the outputs then hold)."""
        function = self._executables.get(executable_id)
        if not isinstance(function, colocated.PythonFunction):
            error = (function.error if isinstance(function, Unloadable) else
                     errors.InternalError(f"colocated program {executable_id} is not loaded on "
                                          "this host; this is a bug in isthmus: please report "
                                          "it."))
            return failing(error)
        pending = [[colocated.Pending() for _ in positions]
                   for positions in function.local_out]
        slots = [[BufferId(base + p) for p in positions]
                 for base, positions in zip(results, function.local_out)]
        try:
            inputs = [[self.buffers.value(b) for b in ids_of(ref, positions)]
                       for ref, positions in zip(args, function.local_in)]
        except errors.IsthmusError as e:
            for ids in slots:
                for buffer_id in ids:
                    self.buffers.fail(buffer_id, e)
            return failing(e)
        for ids, values in zip(slots, pending):
            for buffer_id, value in zip(ids, values):
                self.buffers.store(buffer_id, value)
        if self._runner is None:
            self._runner = PythonRunner()
        work = self._runner.submit(stream, lambda: colocated.run(function, self.devices, inputs))
        return self._store(work, slots, pending)

    async def _store(self, work: Awaitable[Outputs], slots: list[list[BufferId]],
                     pending: list[list[colocated.Pending]]) -> None:
        try:
            outputs = await work
        except Exception as e:  # noqa: BLE001
            error = e if isinstance(e, errors.IsthmusError) else errors.InternalError(
                f"a colocated call failed unexpectedly ({type(e).__name__}: {e}); this is a bug "
                "in isthmus: please report it with the worker log.")
            outputs = None
        # The group re-formed while the call ran: its outputs go to the host that took its
        # placeholders over (the latest, should it re-form again during the move).
        host: PythonCalls = self
        while outputs is not None:
            target = next((p.moved_to for ps in pending for p in ps if p.moved_to), host)
            if target is host:
                break
            try:
                outputs = await asyncio.get_running_loop().run_in_executor(
                    self._pool, _onto, outputs, host.devices, target.devices)
            except Exception as e:  # noqa: BLE001 - its device left the group, say
                error = errors.WorkerLost(
                    f"the outputs of a colocated call could not be moved into the re-formed "
                    f"collective group ({type(e).__name__}: {e}); call it again.")
                outputs = None
            host = target
        for index, (ids, placeholders) in enumerate(zip(slots, pending)):
            for position, (buffer_id, placeholder) in enumerate(zip(ids, placeholders)):
                value = Failed(error) if outputs is None else outputs[index][position]
                placeholder.resolve(value)
                if host.buffers.slot(buffer_id) is placeholder:  # not freed meanwhile
                    host.buffers.store(buffer_id, value)
        if outputs is None:
            raise error

    async def take_calls(self, calls: dict[BufferId, colocated.Pending],
                         old_devices: dict[int, JaxlibDevice]) -> None:
        """Takes over the placeholders of colocated calls that were running on an earlier
        group's host (`DeviceHost.adopt`), on the event loop, where calls store their
        outputs: one whose call has ended since gets its output moved here; the others wait
        here for their calls (`_store`)."""
        device_ids = {d: g for g, d in old_devices.items()}
        for buffer_id, placeholder in calls.items():
            if not placeholder.resolved():
                placeholder.moved_to = self
                self.buffers.store(buffer_id, placeholder)
                continue
            try:
                value = await asyncio.get_running_loop().run_in_executor(
                    self._pool, regroup.onto, placeholder.value, device_ids, self.devices)
            except Exception as e:  # noqa: BLE001
                value = Failed(errors.WorkerLost(
                    f"buffer {buffer_id} could not be moved into the re-formed collective "
                    f"group ({type(e).__name__}: {e}); recreate the array."))
            self.buffers.store(buffer_id, value)


def _onto(outputs: list[list[Slot]], old_devices: dict[int, JaxlibDevice],
          new_devices: dict[int, JaxlibDevice]) -> list[list[Slot]]:
    device_ids = {d: g for g, d in old_devices.items()}
    return [[regroup.onto(v, device_ids, new_devices) for v in values] for values in outputs]


class PythonRunner:
    """Runs a host's colocated calls: in order within a stream, concurrently across them."""

    THREADS = 32

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.THREADS, thread_name_prefix="isthmus-python")
        self._tails: dict[Hashable, asyncio.Future[Outputs]] = {}  # the last call, by stream
        self._running: set[asyncio.Future[Outputs]] = set()
        self._kept: list[object] = []
        self._releasing: set[asyncio.Task[None]] = set()

    def submit(self, stream: Hashable, work: Callable[[], Outputs]) -> asyncio.Future[Outputs]:
        loop = asyncio.get_running_loop()
        previous = self._tails.get(stream)

        async def after_previous() -> Outputs:
            if previous is not None:
                await asyncio.wait([previous])
            return await loop.run_in_executor(self._pool, work)

        task = loop.create_task(after_previous())
        self._tails[stream] = task
        self._running.add(task)

        def forget(t: asyncio.Future[Outputs]) -> None:
            self._running.discard(t)
            if self._tails.get(stream) is t:
                del self._tails[stream]
            if not t.cancelled():
                t.exception()  # retrieved here; the caller reports it

        task.add_done_callback(forget)
        return task

    def keep_while_busy(self, value: object) -> None:
        """Holds `value` until the calls submitted so far have finished."""
        if not self._running:
            return
        running = list(self._running)
        self._kept.append(value)

        async def release() -> None:
            await asyncio.wait(running)
            self._kept.remove(value)

        task = asyncio.get_running_loop().create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
