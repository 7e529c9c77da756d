"""The controller: one per head process, shared by every session.

It owns the fleet, hands out buffer and executable ids, keeps the account of live buffers per
worker, and caches compiled programs by (program, options, devices) so that two sessions
compiling the same step share one executable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from isthmus import errors
from isthmus.controller.arrays import Buffer, BufferGroup
from isthmus.controller.fleet import Device, Fleet
from isthmus.ids import BufferId, ExecutableId, WorkerId
from isthmus.worker.programs import CompiledInfo, CompileRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Limits and timeouts of the controller."""

    host_buffer_timeout: float = 30.0  # seconds a request waits for host data to start arriving
    max_array_bytes: int = 1 << 40  # larger arrays are refused with RESOURCE_EXHAUSTED
    compile_cache_size: int = 256  # executables kept after every session released them


class Executable:
    """A program compiled for a list of devices, loaded on the workers that own them."""

    __slots__ = ("id", "key", "devices", "device_ids", "positions", "parts", "workers",
                 "compiled", "info", "refs", "error", "request", "epoch", "holders",
                 "output_specs", "input_specs")

    def __init__(self, executable_id: ExecutableId, key: bytes, devices: tuple[Device, ...],
                 request: CompileRequest) -> None:
        self.id = executable_id
        self.key = key
        self.devices = devices
        self.device_ids = tuple(d.id for d in devices)
        self.positions = {d.id: p for p, d in enumerate(devices)}  # device id -> position
        self.request = request
        # The channels that were given the program, and the fleet epoch when that was last
        # checked (`Controller.ensure_loaded`). A worker compiles the program again by itself
        # when its collective group re-forms; a worker that replaced one must be given it.
        self.holders: dict[WorkerId, object] = {}
        self.epoch = -1
        # worker -> positions (in `devices`) of that worker's devices
        parts: dict[WorkerId, list[int]] = {}
        for position, device in enumerate(devices):
            parts.setdefault(device.worker, []).append(position)
        self.parts = {w: tuple(p) for w, p in parts.items()}
        self.workers = tuple(self.parts)  # where its commands go (the controller interns it)
        self.output_specs: list | None = None  # per output, worked out at the first Execute
        self.input_specs: list | None = None  # per input of a colocated Python program
        self.compiled: asyncio.Future[CompiledInfo] | None = None
        self.info: CompiledInfo | None = None
        self.error: errors.IsthmusError | None = None
        self.refs = 0


class Controller:
    """Fleet, ids, accounting and the compilation cache."""

    def __init__(self, fleet: Fleet, config: ControllerConfig | None = None) -> None:
        self.fleet = fleet
        self.config = config or ControllerConfig()
        self._next_buffer_id = 1
        self._executable_ids = itertools.count(1)
        self._private_keys = itertools.count(1)
        self._live: dict[BufferId, BufferGroup] = {}  # by base id
        self._executables: dict[bytes, Executable] = {}
        self._idle: dict[bytes, Executable] = {}  # released executables, oldest first
        self.sessions: set[object] = set()

    # ---- buffers -------------------------------------------------------------------------

    def new_group(self, devices: tuple[Device, ...], nbytes: tuple[int, ...],
                  memory_kind: str | None = None,
                  workers: tuple[WorkerId, ...] | None = None) -> BufferGroup:
        """Names a buffer on each device: ids `base .. base + len(devices) - 1`."""
        base = self._next_buffer_id
        self._next_buffer_id += len(devices)
        if workers is None:
            workers = self.fleet.worker_set(d.worker for d in devices)
        group = BufferGroup(base, devices, workers, nbytes, memory_kind)
        self._live[BufferId(base)] = group
        return group

    def free_groups(self, groups: Sequence[BufferGroup]) -> None:
        """Drops every shard of the groups on their workers (in dispatch order): one shared
        command for all the workers of a group."""
        for group in groups:
            if group.freed:
                continue
            if group.pins or group.freed_at:
                self.free_buffers([Buffer(group, p) for p in range(len(group))])
                continue
            group.freed = True
            self._live.pop(BufferId(group.base), None)
            self.fleet.multicast(group.workers, "free", group.ids)

    def free_buffers(self, buffers: Sequence[Buffer]) -> None:
        """Drops single shards on their workers (in dispatch order)."""
        by_worker: dict[WorkerId, list[BufferId]] = {}
        for buffer in buffers:
            group, position = buffer.group, buffer.position
            if group.freed_position(position):
                continue
            if group.pins and group.pins.get(position):
                if group.free_pending is None:
                    group.free_pending = set()
                group.free_pending.add(position)
                continue
            if group.freed_at is None:
                group.freed_at = set()
            group.freed_at.add(position)
            if len(group.freed_at) == len(group):
                group.freed = True
                self._live.pop(BufferId(group.base), None)
            by_worker.setdefault(buffer.device.worker, []).append(buffer.id)
        for worker, ids in by_worker.items():
            self.fleet.channel(worker).free(ids)

    def pin(self, buffer: Buffer) -> None:
        group = buffer.group
        if group.pins is None:
            group.pins = {}
        group.pins[buffer.position] = group.pins.get(buffer.position, 0) + 1

    def unpin(self, buffer: Buffer) -> None:
        group, position = buffer.group, buffer.position
        assert group.pins is not None
        group.pins[position] -= 1
        if group.pins[position] == 0:
            del group.pins[position]
            if group.free_pending and position in group.free_pending:
                group.free_pending.discard(position)
                self.free_buffers([buffer])

    def poison_slice(self, slice_index: int, error: errors.IsthmusError) -> None:
        """Every buffer on the slice is gone: uses of it report `error` (DATA_LOSS)."""
        for group in self._live.values():
            for position, device in enumerate(group.devices):
                if device.slice_index == slice_index and group.error_at(position) is None:
                    group.set_error(position, error)

    def accounting(self) -> dict[WorkerId, dict[str, int]]:
        """Live buffers and bytes per worker, as the controller counts them."""
        result: dict[WorkerId, dict[str, int]] = {
            w: {"buffers": 0, "bytes": 0} for w in self.fleet.workers}
        for group in self._live.values():
            for position, device in enumerate(group.devices):
                if group.freed_position(position):
                    continue
                entry = result.setdefault(device.worker, {"buffers": 0, "bytes": 0})
                entry["buffers"] += 1
                entry["bytes"] += group.nbytes[position]
        return result

    # ---- programs ------------------------------------------------------------------------

    def executable(self, request: Any, devices: tuple[Device, ...],
                   info: CompiledInfo | None = None) -> Executable:
        """The executable for a program on devices: cached, or compiling from now on.

        A *private* program (colocated Python, a persistence plan) is never shared: it
        belongs to the session that sent it (its code runs for that session's arrays only),
        and it is unloaded as soon as that session releases it. `info` describes it (its
        hosts only unpickle it, or have nothing to load)."""
        if getattr(request, "private", False):
            key = b"python:%d" % next(self._private_keys)
        else:
            key = hashlib.sha256(request.module).digest() + hashlib.sha256(
                request.compile_options).digest() + repr([d.id for d in devices]).encode()
        executable = self._executables.get(key)
        if executable is not None and executable.error is None:
            self._idle.pop(key, None)
            executable.refs += 1
            return executable
        down = self.fleet.unavailable(devices)
        if down is not None:
            raise down
        executable = Executable(ExecutableId(next(self._executable_ids)), key, devices, request)
        executable.workers = self.fleet.worker_set(executable.parts)
        executable.refs = 1
        executable.info = info
        self._executables[key] = executable
        if getattr(request, "on_hosts", True):
            executable.compiled = asyncio.get_running_loop().create_task(
                self._compile(executable, request))
        else:
            executable.compiled = asyncio.get_running_loop().create_future()
            executable.compiled.set_result(info)
        return executable

    def ensure_loaded(self, executable: Executable) -> None:
        """Gives the program to every current worker of `executable` that lacks it (one that
        replaced a lost worker), ahead of the Execute being dispatched. Called at dispatch
        time, so it sees the channels the Execute will go to; O(1) while the fleet is
        unchanged."""
        if executable.epoch == self.fleet.epoch:
            return
        for worker in executable.parts:
            channel = self.fleet.channel(worker)
            if executable.holders.get(worker) is not channel:
                channel.load(executable.id, executable.request)
                executable.holders[worker] = channel
        executable.epoch = self.fleet.epoch

    async def _compile(self, executable: Executable, request: CompileRequest) -> CompiledInfo:
        executable.epoch = self.fleet.epoch
        channels = {worker: self.fleet.channel(worker) for worker in executable.parts}
        executable.holders = dict(channels)
        waits = [channel.compile(executable.id, request) for channel in channels.values()]
        try:
            infos = await asyncio.gather(*waits)
        except errors.IsthmusError as e:
            executable.error = e
            self._executables.pop(executable.key, None)
            raise
        except Exception as e:  # noqa: BLE001
            error = errors.from_runtime_error(e, errors.CompileError, "compilation failed")
            executable.error = error
            self._executables.pop(executable.key, None)
            raise error from None
        if executable.info is None:
            executable.info = infos[0]
        return executable.info

    def release_executable(self, executable: Executable) -> None:
        executable.refs -= 1
        if executable.refs > 0 or executable.error is not None:
            return
        if getattr(executable.request, "private", False):
            self._executables.pop(executable.key, None)
            if getattr(executable.request, "on_hosts", True):
                for worker in executable.parts:
                    self.fleet.channel(worker).drop_executable(executable.id)
            return
        self._idle[executable.key] = executable
        while len(self._idle) > self.config.compile_cache_size:
            key = next(iter(self._idle))
            old = self._idle.pop(key)
            self._executables.pop(key, None)
            for worker in old.parts:
                self.fleet.channel(worker).drop_executable(old.id)

    def stats(self) -> dict[str, object]:
        """Per worker: what the controller accounts ("buffers", "bytes") beside what the
        worker itself reports ("worker_buffers", "worker_bytes")."""
        workers: dict[str, dict[str, int]] = {}
        for worker, account in self.accounting().items():
            reported = self.fleet.channel(worker).stats()
            workers[str(worker)] = {
                **account, "worker_buffers": reported.get("buffers", 0),
                "worker_bytes": reported.get("bytes", 0),
                "worker_executables": reported.get("executables", 0),
                **{k: v for k, v in reported.items()
                   if k.startswith(("device_", "compile_cache_"))}}
        return {"workers": workers, "executables": len(self._executables)}
