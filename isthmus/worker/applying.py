"""Applying the controller's commands to a worker's `DeviceHost` (a mixin of `WorkerAgent`):
one branch per command, and the transfers a command starts (a fetched buffer sent back on the
control stream, a buffer pulled from a peer, a buffer served to one)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from isthmus import errors
from isthmus.hostmem import Assembly, byte_view, map_file
from isthmus.transport import messages as m
from isthmus.transport.base import answered
from isthmus.transport.links import ControllerLink, PeerClient
from isthmus.transport.records import ColocatedProgram, CompileRequest, TraceOptions
from isthmus.worker.commands import Incoming, compile_request, write_fetched
from isthmus.worker.crashes import CrashRecord
from isthmus.worker.host import DeviceHost

SMALL_FETCH_BYTES = 64 << 10  # a fetched buffer this small travels inside its Reply


class CommandApplier:
    """`_apply` and the work it starts; the agent owns the state named here."""

    host: DeviceHost | None
    _incoming: dict[int, Incoming]
    _programs: dict[int, CompileRequest | ColocatedProgram]
    _refused: dict[int, tuple[errors.IsthmusError, tuple[int, ...]]]
    _crashes: CrashRecord
    _link: ControllerLink
    _peers: PeerClient

    def _spawn(self, request: int, work: Any, command: Any = None) -> None:
        raise NotImplementedError

    def _reply(self, request: int, value: Any = None, error: Any = None) -> None:
        raise NotImplementedError

    def _require_host(self) -> DeviceHost:
        if self.host is None:
            raise errors.InternalError("the worker has no collective group yet")
        return self.host

    def _apply(self, c: Any) -> None:
        host = self._require_host()
        if isinstance(c, m.Execute):
            # The crash record names the program while jaxlib dispatches it (`crashes.py`).
            running = self._crashes.running
            running(c.executable)
            try:
                host.execute(c.executable, c.args, c.results, c.copy_first)
            finally:
                running(0)
        elif isinstance(c, m.PutBegin):
            self._incoming[c.buffer] = Incoming(Assembly(c.nbytes), c.device, c.memory_kind,
                                                m.dtype_of(c.dtype), c.shape)
        elif isinstance(c, m.PutData):
            incoming = self._incoming[c.buffer]
            value = incoming.add(c.offset, c.data)
            if c.last:
                del self._incoming[c.buffer]
                self._spawn(c.request, host.put(c.buffer, incoming.device, value,
                                                incoming.memory_kind))
        elif isinstance(c, m.PutObjects):
            self._spawn(c.request, host.put(c.buffer, c.device, c.value))
        elif isinstance(c, m.Fail):
            host.fail(c.buffer, c.error)
        elif isinstance(c, m.Copy):
            host.copy(c.src, c.dst, c.device, c.memory_kind)
        elif isinstance(c, m.Assemble):
            host.assemble(c.dst, c.device, c.memory_kind, m.dtype_of(c.dtype), c.shape,
                          c.parts)
        elif isinstance(c, m.Bitcast):
            host.bitcast(c.src, c.dst, m.dtype_of(c.dtype), c.shape)
        elif isinstance(c, m.Free):
            host.free(c.buffers)
        elif isinstance(c, m.Compile):
            self._programs[c.executable] = compile_request(c)
            self._spawn(c.request, self._compile(host, c))
        elif isinstance(c, m.Load):
            self._programs[c.executable] = compile_request(c)
        elif isinstance(c, m.CallPython):
            self._spawn(c.request, host.call_python(c.executable, c.args, c.results, c.stream))
        elif isinstance(c, m.CompilePython):
            self._programs[c.executable] = c.program
            self._spawn(c.request, host.compile(c.executable, c.program))
        elif isinstance(c, m.LoadPython):
            self._programs[c.executable] = c.program
        elif isinstance(c, m.WriteShards):
            self._spawn(c.request, host.write_shards(c.location, c.items))
        elif isinstance(c, m.WriteMeta):
            self._spawn(c.request, host.write_meta(c.location, c.dtype, c.shape, c.boxes))
        elif isinstance(c, m.ReadShards):
            self._spawn(c.request, host.read_shards(c.location, c.dtype, c.shape, c.items))
        elif isinstance(c, m.DropExecutable):
            self._programs.pop(c.executable, None)
            host.drop_executable(c.executable)
        elif isinstance(c, m.Refuse):
            self._refused[c.executable] = (c.error, tuple(c.device_ids))
            self._programs.pop(c.executable, None)
            host.drop_executable(c.executable)
        elif isinstance(c, m.Ready):
            if host.all_ready(c.buffers):  # the common case of a small step: answer now
                self._reply(c.request)
            else:
                self._spawn(c.request, host.ready(c.buffers), c)
        elif isinstance(c, m.Fetch):
            fetched = host.fetch(c.buffer)
            if (answered(fetched) and fetched.result().dtype != object
                    and fetched.result().nbytes <= SMALL_FETCH_BYTES):
                self._reply(c.request, fetched.result())  # a small step's result: now
            else:
                self._spawn(c.request, self._send_buffer(c.request, fetched), c)
        elif isinstance(c, m.PutFile):
            value = map_file(c.path).view(m.dtype_of(c.dtype)).reshape(c.shape)
            self._spawn(c.request, host.put(c.buffer, c.device, value, c.memory_kind))
        elif isinstance(c, m.FetchFile):
            self._spawn(c.request, write_fetched(host.fetch(c.buffer), c.path), c)
        elif isinstance(c, m.Pull):
            self._spawn(c.request, self._pull(host, c))
        elif isinstance(c, m.StartProfile):
            self._spawn(c.request, host.start_profile(c.trace, TraceOptions(
                c.host_tracer_level, c.python_tracer_level, tuple(c.advanced))))
        elif isinstance(c, m.StopProfile):
            self._spawn(c.request, host.stop_profile(c.trace, c.directory, c.label))
        else:
            raise errors.InternalError(f"unknown command {type(c).__name__}")

    async def _compile(self, host: DeviceHost, c: m.Compile) -> Any:
        info = await host.compile(c.executable, self._programs[c.executable])
        self._crashes.compiled(c.executable, info.name)
        return dataclasses.replace(info, param_avals=())

    async def _send_buffer(self, request: int, fetched: Any) -> Any:
        value = await fetched
        if value.dtype == object or value.nbytes <= SMALL_FETCH_BYTES:
            return value  # in the Reply itself: one frame
        flat = byte_view(value)
        self._link.send(m.FetchHeader(request, m.dtype_name(value.dtype), value.shape,
                                      flat.nbytes))
        for start in range(0, flat.nbytes, m.PIECE_BYTES):
            self._link.send(m.Data(request, start, m.Bulk(flat[start:start + m.PIECE_BYTES])))
        return None

    async def _pull(self, host: DeviceHost, c: m.Pull) -> None:
        value = await self._peers.fetch(c.peer, c.src)
        host = self._require_host()  # the group may have re-formed while the bytes came
        await host.put(c.dst, c.device, value, c.memory_kind)
        if not host.has(c.dst):
            raise errors.InternalError("the pulled buffer was not stored")

    async def _serve_buffer(self, buffer_id: int) -> np.ndarray:
        # A peer may ask before this worker has applied the command that makes the buffer.
        for _ in range(3000):
            if self.host is not None and self.host.has(buffer_id):
                return await self.host.fetch(buffer_id)
            await asyncio.sleep(0.01)
        raise errors.InternalError(f"buffer {buffer_id} never appeared on this worker")
