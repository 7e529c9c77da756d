"""The device side of one host: buffers and executables on a jaxlib client.

`DeviceHost` is what a worker process runs and what the embedded backend runs in-process. It
knows nothing of sessions or handles: it stores shard buffers under controller-chosen
`BufferId`s, compiles programs under `ExecutableId`s, and executes them. Dispatch calls
return at once (jaxlib runs the work asynchronously); waiting is done by `ready` and `fetch`,
which move the blocking wait to a thread so the caller's event loop keeps going.

Errors belong to buffers: a buffer that could not be produced keeps its exception, and every
later operation on it reports that exception.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np

from isthmus import errors
from isthmus.compat.jaxlib_types import (
    JaxlibClient,
    JaxlibDevice,
    JaxSharding,
    LoadedExecutable,
)
from isthmus.hostmem import map_file
from isthmus.ids import BufferId, ExecutableId
from isthmus.transport import records
from isthmus.transport.base import Commands
from isthmus.transport.commands import ORDERED_PUT_BYTES, Command, Request
from isthmus.transport.host import Part
from isthmus.worker import platforms, programs, regroup, reshaping, runs
from isthmus.worker.buffers import BufferStore, ids_of
from isthmus.worker.collectives import CollectiveOrder
from isthmus.worker.colocated import Pending, Program
from isthmus.worker.compile_cache import CompileCache, KeptExecutables
from isthmus.worker.inline import InlineOrder
from isthmus.worker.persistence import Checkpoints
from isthmus.worker.profiler import HostProfiles
from isthmus.worker.python_calls import PythonCalls
from isthmus.worker.reads import Reads
from isthmus.worker.runs import launch_id
from isthmus.worker.slots import (
    HostArray,
    Loaded,
    Unloadable,
    already_done,
    computation_error,
    failed_now,
    failing,
    make_cpu_client,
    place,
)

if TYPE_CHECKING:
    from isthmus.transport.flow import FlowGate

__all__ = ["DeviceHost", "computation_error", "launch_id", "make_cpu_client"]


logger = logging.getLogger(__name__)

_T = TypeVar("_T")

class DeviceHost:
    """Buffers and executables of the local devices of one jaxlib client.

    Devices are named by their global (fleet-wide) ids; `device_map` turns them into the
    client's devices. In the embedded backend the two numberings are the same. In a worker
    the client may span several processes (a collective group): then `devices` covers every
    device of the group, of which only the local ones hold buffers here. `companions` maps
    the global ids of the group's colocated CPU devices (an accelerator fleet's; see
    `controller/fleet.py`) to the devices of a CPU client of their own (a group of its
    own too); they hold buffers and run programs and colocated Python like the others.
    """

    def __init__(self, client: JaxlibClient, device_map: dict[int, int] | None = None, *,
                 pool: concurrent.futures.Executor | None = None,
                 compile_cache: CompileCache | KeptExecutables | None = None,
                 companions: dict[int, JaxlibDevice] | None = None) -> None:
        import jax

        # Buffers must keep the client's dtypes: without x64, jax.device_put would turn
        # int64/float64 host data into 32-bit buffers.
        jax.config.update("jax_enable_x64", True)
        self.client = client
        by_id = {d.id: d for d in client.devices()}
        if device_map is None:
            device_map = {i: i for i in by_id}
        self.devices = {g: by_id[j] for g, j in device_map.items() if j in by_id}
        companions = companions or {}
        self.devices.update(companions)
        # The jaxlib devices that hold buffers here (two clients may number them alike).
        self._local = set(client.local_devices()) | {
            d for d in companions.values() if d.process_index == d.client.process_index()}
        # XLA:CPU meets a program's local devices in an in-process rendezvous on a shared
        # thread pool (see `CollectiveOrder.settled`); GPU devices each have their own
        # stream.
        shared_pool = self.on_cpu = getattr(client, "platform", "cpu") == "cpu"
        self.buffers = BufferStore()  # the shard buffers, in explicit states (buffers.py)
        self._shardings: dict[tuple[int, str | None], JaxSharding] = {}  # see `_sharding`
        self._executables: dict[ExecutableId, Program] = {}
        self._writes: set[asyncio.Future[None]] = set()  # host data being placed, in threads
        self._pool = pool or concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="isthmus-host"
        )
        self.compile_cache = compile_cache  # executables kept across groups or restarts
        # Parts: colocated Python calls and checkpoint I/O (over the buffers, devices and
        # programs), and profiles.
        # The collective programs in flight, and when the next may go.
        self.collectives = CollectiveOrder(self._executables, self._pool, shared_pool, self.fail)
        self.python = PythonCalls(self.buffers, self.devices, self._local, self._executables,
                                  self._pool)
        self.checkpoints = Checkpoints(self.buffers, self.devices, self._pool, self._storing)
        # Reads (readiness waits, fetches) of computed buffers; a later program donates a
        # copy of what one still reads.
        self.reads = Reads(self.buffers, self._pool)
        self.profiles = HostProfiles()
        self._inline = InlineOrder(self)  # its order as the embedded backend's channel

    # ---- buffers -------------------------------------------------------------------------

    # Host data larger than this is placed from a thread, so the event loop keeps going;
    # the controller counts on smaller data being stored in command order.
    INLINE_PUT_BYTES = ORDERED_PUT_BYTES

    def put(self, buffer_id: BufferId, device_id: int, value: np.ndarray,
            memory_kind: str | None = None) -> Awaitable[None]:
        """Stores `value` on a device; resolves once it is stored and ready there, or fails
        with the reason it could not be (the buffer then holds that error). The controller
        counts on it: an array whose puts all resolved is ready without asking again
        (`SessionMoves.ready`). `value` must not change."""
        if value.dtype == object:  # IFRT string arrays stay host objects
            self.buffers.store(buffer_id, HostArray(value))
            return already_done()
        if value.nbytes <= self.INLINE_PUT_BYTES:
            error = self._put_blocking(buffer_id, device_id, value, memory_kind)
            return already_done() if error is None else failed_now(error)
        return self._write(self._put_or_raise, buffer_id, device_id, value, memory_kind)

    def _write(self, placing: Callable[..., None], *args: object) -> Awaitable[None]:
        """Runs `placing(*args)` (host data placed on a device) in the pool; `settle_writes`
        waits for it."""
        return self._storing(
            asyncio.get_running_loop().run_in_executor(self._pool, placing, *args))

    def _storing(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """Runs `work`, which stores buffers when it ends (a put placed in a thread, shards
        read from a checkpoint), so that `settle_writes` waits for it: buffers stored in
        this host after a new group adopted its buffers would be lost to the new one."""
        write = asyncio.ensure_future(work)
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        return write

    def put_file(self, buffer_id: BufferId, device_id: int, path: str, dtype: np.dtype,
                 shape: tuple[int, ...], memory_kind: str | None = None) -> Awaitable[None]:
        """`put` of bytes that wait in a file of the controller's shared directory
        (`PutFile`), mapped copy-on-write. On an accelerator the mapping's pages are made
        present all at once, in the put's thread (`hostmem.map_file(populate=True)`): a
        `device_put` that faulted them in one by one ran at a sixth of the speed on the TPU
        machine's sandbox. A CPU backend may alias the mapping: its pages come as read."""
        if self.on_cpu:
            return self.put(buffer_id, device_id, map_file(path).view(dtype).reshape(shape),
                            memory_kind)
        return self._write(self._put_file_or_raise, buffer_id, device_id, path, dtype, shape,
                           memory_kind)

    def _put_file_or_raise(self, buffer_id: BufferId, device_id: int, path: str,
                           dtype: np.dtype, shape: tuple[int, ...],
                           memory_kind: str | None) -> None:
        try:
            value = map_file(path, populate=True).view(dtype).reshape(shape)
        except (OSError, ValueError) as e:
            error = errors.InternalError(
                f"the worker could not map the put's file {path} ({e}); this is a bug in "
                "isthmus, or the shared directory was changed under it.")
            self.fail(buffer_id, error)
            raise error from None
        self._put_or_raise(buffer_id, device_id, value, memory_kind)

    async def settle_writes(self) -> None:
        """Waits until host data being placed from threads is stored (`adopt` then sees it)."""
        while self._writes:
            await asyncio.wait(list(self._writes))

    def _put_blocking(self, buffer_id: BufferId, device_id: int, value: np.ndarray,
                      memory_kind: str | None) -> errors.IsthmusError | None:
        """Places and stores `value`, and waits until it is ready; the error it met, if
        any (then stored as the buffer's)."""
        try:
            placed = place(value, self._sharding(device_id, memory_kind),
                           self.devices[device_id])
            placed.block_until_ready()
        except Exception as e:  # noqa: BLE001 - jaxlib raises ValueError, RuntimeError, ...
            error = errors.from_runtime_error(
                e, errors.InvalidRequest, "could not place the host data on the device")
            self.fail(buffer_id, error)
            return error
        self.buffers.store(buffer_id, placed)
        return None

    def _put_or_raise(self, buffer_id: BufferId, device_id: int, value: np.ndarray,
                      memory_kind: str | None) -> None:
        error = self._put_blocking(buffer_id, device_id, value, memory_kind)
        if error is not None:
            raise error

    def _sharding(self, device_id: int, memory_kind: str | None) -> JaxSharding:
        """Where host data or a copy goes: a device's SingleDeviceSharding (in a memory
        kind, or its default memory)."""
        sharding = self._shardings.get((device_id, memory_kind))
        if sharding is None:
            from jax.sharding import SingleDeviceSharding

            sharding = SingleDeviceSharding(self.devices[device_id], memory_kind=memory_kind)
            self._shardings[(device_id, memory_kind)] = sharding
        return sharding

    def fail(self, buffer_id: BufferId, error: errors.IsthmusError) -> None:
        """Makes `buffer_id` an error buffer: every use of it reports `error`."""
        self.buffers.fail(buffer_id, error)

    def copy(self, src: BufferId, dst: BufferId, device_id: int,
             memory_kind: str | None = None) -> None:
        """Copies a buffer to another local device (or memory kind): `reshaping.copy`."""
        reshaping.copy(self.buffers, src, dst, lambda: self._sharding(device_id, memory_kind))

    def assemble(self, dst: BufferId, device_id: int, memory_kind: str | None,
                 dtype: np.dtype | type[object] | None, shape: tuple[int, ...],
                 parts: Sequence[Part]) -> None:
        """Builds `dst` on a device from boxes of local buffers: `reshaping.assemble`."""
        reshaping.assemble(self.buffers, self.devices, dst, device_id, memory_kind, dtype,
                           shape, parts)

    def bitcast(self, src: BufferId, dst: BufferId, dtype: np.dtype | type[object],
                shape: tuple[int, ...]) -> None:
        """`dst` holds the bytes of `src` read as another dtype and shape: `reshaping`."""
        reshaping.bitcast(self.buffers, src, dst, dtype, shape)

    def free(self, buffer_ids: Sequence[BufferId]) -> None:
        # Dropping the reference frees the memory once no in-flight work uses it. An explicit
        # delete() here could free a buffer under a host copy running in another thread.
        self.buffers.free(buffer_ids)

    def has(self, buffer_id: BufferId) -> bool:
        return buffer_id in self.buffers

    def stats(self) -> dict[str, int]:
        stored = self.buffers.stored_arrays()
        cache = self.compile_cache.stats() if self.compile_cache is not None else {}
        return {"buffers": len(stored), "bytes": sum(v.nbytes for v in stored),
                "executables": sum(isinstance(e, Loaded) for e in self._executables.values()),
                "programs_compiled": programs.LOADS["compiled"],
                "programs_vetted": programs.LOADS["vetted"],
                **cache, **self.device_memory()}

    def device_memory(self) -> dict[str, int]:
        """The client's own memory figures (`platforms.device_memory`)."""
        return platforms.device_memory(self.client, getattr(self, "devices", {}))

    def all_ready(self, buffer_ids: Sequence[BufferId]) -> bool:
        return self.reads.all_ready(buffer_ids)

    def ready(self, buffer_ids: Sequence[BufferId]) -> Awaitable[None]:
        return self.reads.ready(buffer_ids)

    def held(self) -> Awaitable[list[int]]:
        done: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        done.set_result([int(i) for i in self.buffers.ids()])
        return done

    def default_layout(self, dtype: str, shape: tuple[int, ...], device: int) -> Awaitable[str]:
        try:
            layout = platforms.default_layout(self.devices.get(device), dtype, shape)
        except errors.IsthmusError as e:
            return failing(e)
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        done.set_result(layout)
        return done

    def fetch(self, buffer_id: BufferId, nbytes: int = 0) -> Awaitable[np.ndarray]:
        return self.reads.fetch(buffer_id)

    # ---- programs ------------------------------------------------------------------------

    def compile(self, executable_id: ExecutableId,
                request: records.CompileRequest | records.ColocatedProgram
                ) -> Awaitable[records.CompiledInfo | None]:
        """Starts compiling a StableHLO program for local devices, in a thread (a colocated
        Python program is unpickled instead, and resolves to None)."""
        if isinstance(request, records.ColocatedProgram):
            return self.python.load(executable_id, request)
        work = asyncio.get_running_loop().run_in_executor(
            self._pool, self._compile_blocking, request)
        return self._finish_compile(executable_id, request, work)

    async def _finish_compile(self, executable_id: ExecutableId,
                              request: records.CompileRequest,
                              work: Awaitable[Loaded]) -> records.CompiledInfo:
        try:
            loaded = await work
        except Exception as e:
            # Executes of it fail their outputs with this error (not with "not loaded").
            self._executables[executable_id] = Unloadable(
                errors.from_runtime_error(e, errors.CompileError, "compilation failed"),
                self.local_positions(request.device_ids))
            raise
        self._executables[executable_id] = loaded
        return loaded.info

    def knows(self, executable_id: ExecutableId) -> bool:
        """The program is loaded here, or failed to compile here."""
        return executable_id in self._executables

    def _compile_blocking(self, request: records.CompileRequest) -> Loaded:
        try:
            devices = tuple(self.devices[d] for d in request.device_ids)
        except KeyError as e:
            raise errors.InternalError(
                f"device {e} is not in this worker's group; the controller and worker "
                "disagree, which is a bug in isthmus: please report it.") from None
        clients = {id(d.client) for d in devices}
        if len(clients) > 1:  # the controller refuses these first
            raise errors.InvalidRequest(
                "the program spans accelerators and colocated CPU devices; run it on one "
                "kind of device.")
        executable, info = programs.compile_program(devices[0].client, devices, request,
                                                    self.compile_cache)
        positions = self.local_positions(request.device_ids)
        span = (frozenset(request.device_ids) if len(positions) < len(request.device_ids)
                else None)
        return Loaded(executable, info, devices, programs.arg_shardings(info, devices),
                      positions, span, programs.result_handlers(info, devices))

    def local_positions(self, device_ids: Sequence[int]) -> tuple[int, ...]:
        """Positions (in a program's device list) of the devices this host holds."""
        return tuple(i for i, d in enumerate(device_ids)
                     if d in self.devices and self.devices[d] in self._local)

    def load(self, executable_id: ExecutableId,
             request: records.CompileRequest | records.ColocatedProgram) -> None:
        """In-process hosts never lose their programs: nothing to do."""

    def drop_executable(self, executable_id: ExecutableId) -> None:
        self.python.drop(self._executables.pop(executable_id, None))

    def program_text(self, executable_id: ExecutableId) -> Awaitable[str]:
        return self._describe(executable_id, programs.program_text)

    def cost_analysis(self, executable_id: ExecutableId) -> Awaitable[dict[str, object]]:
        return self._describe(executable_id, programs.cost_analysis)

    def _describe(self, executable_id: ExecutableId,
                  what: Callable[[LoadedExecutable], _T]) -> Awaitable[_T]:
        """`what` of a compiled program, worked out in the compile threads (printing a
        large program takes milliseconds); its compile's error if it failed here."""
        loaded = self._executables.get(executable_id)
        if isinstance(loaded, Unloadable):
            return failing(loaded.error)
        if not isinstance(loaded, Loaded):
            return failing(errors.InternalError(
                f"executable {executable_id} is not a program compiled on this host; the "
                "controller and worker disagree, which is a bug in isthmus: please report it."))
        return asyncio.get_running_loop().run_in_executor(self._pool, what, loaded.executable)

    def execute(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
                results: Sequence[int], copy_first: frozenset[int] = frozenset()) -> None:
        """Runs an executable on this host's shards (see `WorkerChannel.execute`).

        `args[i]` names argument i's shards: a group base (position p is `base + p`) or one
        id per position of the program's devices; `results[j]` is output j's group base.
        Arguments listed in `copy_first` are copied before the call so that donation cannot
        consume them.
        """
        # An Execute names a compiled program (colocated functions run by `python.call`); an
        # annotation, not a cast: no call on the hot path.
        loaded: Loaded | Unloadable | None = self._executables.get(  # type: ignore[assignment]
            executable_id)
        # The common step: a program on this one device (it has result handlers), nothing
        # copied first, no peer to wait for (`runs.run_one`).
        if (type(loaded) is Loaded and loaded.result_handlers is not None and not copy_first
                and not (self.reads.in_flight and loaded.info.donated_inputs)
                and not self.buffers.spanning()):
            try:
                runs.run_one(loaded, self.buffers, args,
                             results,  # type: ignore[arg-type]  # group bases: BufferIds
                             copy_first)
            except Exception as e:  # noqa: BLE001
                self._run_failed(e, results, loaded.positions)
            return
        positions = loaded.positions if loaded is not None else ()
        token = None  # of a run over several devices (`InFlight`)
        try:
            if isinstance(loaded, Unloadable):
                raise loaded.error
            if loaded is None:
                raise errors.InternalError(
                    f"executable {executable_id} is not loaded on this host; this is a bug in "
                    "isthmus: please report it.")
            if self.reads.in_flight and loaded.info.donated_inputs:
                copy_first = copy_first | self.reads.in_flight.donated_in_flight(
                    args, positions, loaded.info.donated_inputs)
            # What its inputs wait for, read before donation deletes them (outputs wait
            # for whatever peers their inputs wait for).
            waits = ([s for ref in args for s in self.buffers.spans_of(ids_of(ref, positions))]
                     if self.buffers.spanning() else [])
            if len(loaded.devices) == 1 and loaded.result_handlers is not None and not waits:
                runs.run_one(loaded, self.buffers, args,
                             results,  # type: ignore[arg-type]  # group bases: BufferIds
                             copy_first)
                return
            if len(loaded.devices) == 1:
                values = runs.arguments_one(self.buffers, args, copy_first)
                per_output = [[value] for value in loaded.executable.execute(values)]
            else:
                per_output, token = runs.run_sharded(loaded, self.buffers, args, positions,
                                                     copy_first, launch_id(results))
        except Exception as e:  # noqa: BLE001
            self._run_failed(e, results, positions)
            return
        store = self.buffers.store
        if positions == (0,):  # one device: an output's id is its base
            for base, shards in zip(cast("Sequence[BufferId]", results), per_output):
                store(base, shards[0])
        else:
            for base, shards in zip(results, per_output):
                for p, shard in zip(positions, shards):
                    store(BufferId(base + p), shard)
        span = loaded.span
        if waits:
            span = frozenset().union(span or (), *waits)
        if span is not None:
            for base in results:
                for p in positions:
                    self.buffers.span(BufferId(base + p), span)
        if len(positions) > 1 or loaded.span is not None:
            self.collectives.started([s for shards in per_output for s in shards], token)

    def _run_failed(self, e: Exception, results: Sequence[int], positions: Sequence[int]
                    ) -> None:
        """A run that raised: its outputs here hold the error."""
        error = errors.from_runtime_error(e, errors.ExecutionError, "execution failed")
        for base in results:
            for p in positions:
                self.fail(BufferId(base + p), error)

    # ---- WorkerChannel (the embedded backend's controller talks to its host directly) ----

    local = True  # `WorkerChannel.local`: in the controller's process

    def send(self, command: Command) -> None:
        self._inline.send(command)

    def ask(self, request: Request[_T]) -> Awaitable[_T]:
        return self._inline.ask(request)

    def deliver(self, commands: Commands, more: bool = False) -> None:
        """Commands shared with other workers."""
        self._inline.deliver(commands)

    def attach_flow(self, gate: FlowGate, key: Hashable) -> None:
        """The fleet's flow gate, which this channel's backlog closes (`InlineOrder`)."""
        self._inline.attach_flow(gate, key)

    def adopt(self, old: DeviceHost, reason: str = "", wait: float = 30.0
              ) -> tuple[int, dict[BufferId, Pending]]:
        """Moves `old`'s buffers into this host's client (a new collective group) and empties
        `old` (`regroup.adopt`). Blocking; run it in a thread."""
        old._executables.clear()
        return regroup.adopt(old.buffers, old.devices, self.buffers, self.devices, reason,
                             wait)

    async def close(self) -> None:
        self._inline.close()
        self.free(self.buffers.ids())
        self._executables.clear()

