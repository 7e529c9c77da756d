"""Applying the controller's commands to a worker's `DeviceHost` (a part of `WorkerAgent`):
each inside one guard, after what it waits for (its program loaded, the collective programs
before it), a command that raises refused by itself (`_refuse`); most by their own record
(`transport/commands.py`), a few here because they need the process (its crash record, the
programs it keeps across groups, the transfers a command starts: a put arriving in pieces, a
fetched buffer sent back on the control stream, a buffer pulled from a peer, a buffer served
to one). `transport/commands.py` lists them, and why each is handled here."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import numpy as np

from isthmus import errors
from isthmus.hostmem import Assembly, byte_view
from isthmus.ids import BufferId, ExecutableId
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.base import answered
from isthmus.transport.links import ControllerLink, PeerClient
from isthmus.transport.records import ColocatedProgram, CompiledInfo, CompileRequest
from isthmus.worker.crashes import CrashRecord
from isthmus.worker.host import DeviceHost
from isthmus.worker.membership import Membership
from isthmus.worker.reading import Incoming, produced, request_of, write_fetched

logger = logging.getLogger(__name__)

SMALL_FETCH_BYTES = 64 << 10  # a fetched buffer this small travels inside its Reply


class Worker(Protocol):
    """What `CommandApplier` uses of its worker (`WorkerAgent`): its host (None until it
    joins a group, replaced when the group re-forms), its links, crash record and
    membership, and how it answers the controller."""

    host: DeviceHost | None
    log_path: str  # the worker's log file ("": none), named in errors
    link: ControllerLink
    peers: PeerClient
    crashes: CrashRecord
    # Whether a FormGroup waits behind the commands being applied, what the coming group
    # will lack and why (`membership.py`).
    membership: Membership

    def spawn(self, request: int, work: Awaitable[object],
              command: m.Ask | m.FetchFile | None = None) -> None:
        """Runs `work` for an asked request; its answer goes back when it resolves."""
        ...

    def reply(self, request: int, value: object = None,
              error: errors.IsthmusError | None = None) -> None:
        """Answers an asked request."""
        ...


class CommandApplier:
    """A worker's commands applied to its host: a part of `WorkerAgent` (`agent.applier`),
    owning the programs the controller gave the worker, those it refused, and the puts
    arriving in pieces."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        # Every program the controller gave this worker, by executable id. Kept across
        # collective groups: after a re-formation a program is loaded again on first use
        # (from the worker's kept executables when a group of the same members compiled
        # it before).
        self.programs: dict[int, CompileRequest | ColocatedProgram] = {}
        # Programs the controller refused (they crashed a worker): executable id -> (the
        # error their Executes fail with, their devices' global ids).
        self.refused: dict[int, tuple[errors.IsthmusError, tuple[int, ...]]] = {}
        self.incoming: dict[int, Incoming] = {}  # puts arriving in pieces
        self.applying = ""  # what the command being applied waits for (heartbeats say)

    def reset(self) -> None:
        """Forgets everything: the worker serves a new controller."""
        self.incoming.clear()
        self.programs.clear()
        self.refused.clear()

    def apply_now(self, command: c.Told) -> bool:
        """Applies a command that waits for nothing (`apply_command`'s waits): a plain
        command, or an Execute of a program loaded here that meets no other program in a
        collective; the common case of a step, applied without a coroutine. False: the
        command is left to `apply_command`."""
        kind = type(command)
        if kind is c.Execute:
            host, executable = self._worker.host, command.executable
            if (host is None or executable in self.refused or not host.knows(executable)
                    or host.collectives.is_collective(executable)):
                return False
            self._worker.crashes.fault(executable)
            self._on_execute(host, command)
            return True
        if kind is c.Free and self._worker.host is not None:  # the step's other command
            command.apply(self._worker.host)
            return True
        if isinstance(command, c.Execute) or (
                isinstance(command, m.Ask) and isinstance(command.command, c.CallPython)):
            return False
        self.apply(command)
        return True

    async def apply_command(self, command: c.Told) -> None:
        """Applies one command of a batch, after what it must wait for: its program loaded,
        the collective programs before it (`CollectiveOrder.settled`)."""
        worker = self._worker
        if isinstance(command, m.Ask) and isinstance(command.command, c.CallPython):
            self.applying = "loading a colocated Python function"
            await self._load(command.command.executable)
        elif isinstance(command, c.Execute):
            if command.executable in self.refused:
                self._fail_refused(command)
                return
            self.applying = f"compiling program {command.executable}"
            await self._load(command.executable)
            worker.crashes.fault(command.executable)
            host = worker.host  # the group may re-form while this command waits
            if host is not None and host.collectives.is_collective(command.executable):
                self.applying = (f"program {command.executable} waits for the collective "
                                 "programs before it")
                membership = worker.membership
                await host.collectives.settled(command.executable, membership.superseded)
                if membership.superseded.is_set() and host.collectives.spans_any(
                        command.executable, membership.gone):
                    # It would wait for a lost peer on a broken communicator.
                    host.collectives.fail_outputs(command.executable, command.results,
                                                  errors.WorkerLost(
                        f"the program spanned a worker that was lost "
                        f"({membership.pending_reason or 'a peer left the collective group'}); "
                        "run it again on the slices that are up."))
                    return
        self.applying = ""
        self.apply(command)

    def refuse(self, command: c.Told, e: Exception) -> None:
        """A command that could not be applied: whoever waits on it hears why, and the
        buffers it was to produce hold the error (nothing waits forever)."""
        name = type(command.command if isinstance(command, m.Ask) else command).__name__
        where = f" ({self._worker.log_path})" if self._worker.log_path else ""
        error = e if isinstance(e, errors.IsthmusError) else errors.InternalError(
            f"the worker could not apply {name} ({type(e).__name__}: {e}); "
            f"this is a bug in isthmus: please report it with the worker log{where}.")
        if not isinstance(e, errors.IsthmusError):
            logger.exception("command %s failed; what it was to make holds the error", name)
        request = request_of(command)
        if request is not None:
            self._worker.reply(request, error=error)
        host = self._worker.host
        if host is not None:
            if isinstance(command, c.Execute):  # its outputs, by the program's positions
                host.collectives.fail_outputs(command.executable, command.results, error)
            for buffer_id in produced(command):
                host.fail(buffer_id, error)

    def _fail_refused(self, command: c.Execute) -> None:
        """An Execute of a program the controller refused: its outputs here hold the error."""
        host = self._worker.host
        if host is None:
            return
        error, device_ids = self.refused[command.executable]
        positions = host.local_positions(device_ids)
        for base in command.results:
            for p in positions:
                host.fail(BufferId(base + p), error)

    async def _load(self, executable: ExecutableId) -> None:
        """Compiles a known program that the current client lacks (the group re-formed, or
        the program came with `Load`), before the Execute that needs it is applied. A
        failure is kept by the host and fails that Execute's outputs."""
        host, request = self._worker.host, self.programs.get(executable)
        if host is None or request is None or host.knows(executable):
            return
        try:
            info = await host.compile(executable, request)
        except Exception:
            logger.warning("compiling program %s again failed", executable, exc_info=True)
            return
        if info is not None:
            self._worker.crashes.compiled(executable, info.name)

    def _require_host(self) -> DeviceHost:
        host = self._worker.host
        if host is None:
            raise errors.InternalError("the worker has no collective group yet")
        return host

    def apply(self, message: c.Told) -> None:
        """Applies one command of a batch: by its record's own `apply`, or, for the few
        whose handling needs this process (`_TOLD`, `_ASKED`), here."""
        host = self._require_host()
        if isinstance(message, m.Ask):
            request, command = message.request, cast("c.Request[object]", message.command)
            asked = _ASKED.get(type(command))
            if asked is not None:
                asked(self, host, request, command)
                return
            outcome = command.apply(host)
            # One that waits for computations not done yet is asked again if the group
            # re-forms (`_spawn`); one answered already is answered now.
            waits = command.waits_for_computations and not answered(outcome)
            self._worker.spawn(request, outcome, message if waits else None)
            return
        told = _TOLD.get(type(message))
        if told is not None:
            told(self, host, message)
        elif isinstance(message, c.Command) and not isinstance(message, c.Request):
            message.apply(host)
        else:
            raise errors.InternalError(f"unknown command {type(message).__name__}")

    # ---- commands whose handling needs the worker process --------------------------------

    def _on_execute(self, host: DeviceHost, command: c.Execute) -> None:
        # The crash record names the program while jaxlib dispatches it (`crashes.py`).
        running = self._worker.crashes.running
        running(command.executable)
        try:
            command.apply(host)
        finally:
            running(0)

    def _on_load(self, host: DeviceHost, command: c.Load) -> None:
        self.programs[command.executable] = command.program  # compiled at its first run

    def _on_drop(self, host: DeviceHost, command: c.DropExecutable) -> None:
        self.programs.pop(command.executable, None)
        command.apply(host)

    def _on_refuse(self, host: DeviceHost, command: c.Refuse) -> None:
        self.refused[command.executable] = (command.error, tuple(command.device_ids))
        self.programs.pop(command.executable, None)
        command.apply(host)

    def _on_put_begin(self, host: DeviceHost, message: m.PutBegin) -> None:
        self.incoming[message.buffer] = Incoming(
            Assembly(message.nbytes), message.device, message.memory_kind,
            m.dtype_of(message.dtype), message.shape)

    def _on_put_data(self, host: DeviceHost, message: m.PutData) -> None:
        incoming = self.incoming[message.buffer]
        value = incoming.add(message.offset, message.data)
        if message.last:
            del self.incoming[message.buffer]
            self._worker.spawn(message.request, host.put(
                message.buffer, incoming.device, value, incoming.memory_kind))

    def _on_put_whole(self, host: DeviceHost, message: m.PutWhole) -> None:
        pieces = Assembly(len(message.data))
        pieces.add(0, message.data)  # kept as a view of its frame
        value = pieces.value(m.dtype_of(message.dtype), message.shape)
        self._worker.spawn(message.request, host.put(
            message.buffer, message.device, value, message.memory_kind))

    def _on_put_objects(self, host: DeviceHost, message: m.PutObjects) -> None:
        self._worker.spawn(message.request,
                           host.put(message.buffer, message.device, message.value))

    def _on_put_file(self, host: DeviceHost, message: m.PutFile) -> None:
        self._worker.spawn(message.request, host.put_file(
            message.buffer, message.device, message.path, m.dtype_of(message.dtype),
            tuple(message.shape), message.memory_kind))

    def _on_fetch_file(self, host: DeviceHost, message: m.FetchFile) -> None:
        self._worker.spawn(message.request,
                           write_fetched(host.fetch(message.buffer), message.path), message)

    def _on_compile(self, host: DeviceHost, request: int, command: c.Compile) -> None:
        self.programs[command.executable] = command.program
        self._worker.spawn(request, self._compiled(host, command))

    async def _compiled(self, host: DeviceHost, command: c.Compile) -> CompiledInfo | None:
        info = await command.apply(host)
        if info is None:  # colocated Python
            return None
        self._worker.crashes.compiled(command.executable, info.name)
        return dataclasses.replace(info, param_avals=())  # jax's avals stay here

    def _on_describe(self, host: DeviceHost, request: int,
                     command: c.ProgramText | c.CostAnalysis) -> None:
        self._worker.spawn(request, self._described(command))

    async def _described(self, command: c.ProgramText | c.CostAnalysis) -> object:
        """A program the current host lacks (the group re-formed since its compile, or it
        came with `Load`) is compiled first, as for its next run."""
        await self._load(command.executable)
        return await command.apply(self._require_host())

    def _on_fetch(self, host: DeviceHost, request: int, command: c.Fetch) -> None:
        fetched = command.apply(host)
        if (answered(fetched) and fetched.result().dtype != object
                and fetched.result().nbytes <= SMALL_FETCH_BYTES):
            self._worker.reply(request, fetched.result())  # a small step's result: now
        else:
            self._worker.spawn(request, self._send_buffer(request, fetched),
                               m.Ask(request, command))

    def _on_pull(self, host: DeviceHost, request: int, command: c.Pull) -> None:
        self._worker.spawn(request, self._pulled(command))

    async def _send_buffer(self, request: int, fetched: Awaitable[np.ndarray]
                           ) -> np.ndarray | None:
        value = await fetched
        if value.dtype == object or value.nbytes <= SMALL_FETCH_BYTES:
            return value  # in the Reply itself: one frame
        flat = byte_view(value)
        self._worker.link.send(m.FetchHeader(request, m.dtype_name(value.dtype), value.shape,
                                             flat.nbytes))
        for start in range(0, flat.nbytes, m.PIECE_BYTES):
            self._worker.link.send(
                m.Data(request, start, m.Bulk(flat[start:start + m.PIECE_BYTES])))
        return None

    async def _pulled(self, command: c.Pull) -> None:
        value = await self._worker.peers.fetch(command.peer, command.src, command.mac)
        host = self._require_host()  # the group may have re-formed while the bytes came
        await host.put(command.dst, command.device, value, command.memory_kind)
        if not host.has(command.dst):
            raise errors.InternalError("the pulled buffer was not stored")

    async def serve_buffer(self, buffer_id: BufferId) -> np.ndarray:
        # A peer may ask before this worker has applied the command that makes the buffer.
        for _ in range(3000):
            host = self._worker.host
            if host is not None and host.has(buffer_id):
                return await host.fetch(buffer_id)
            await asyncio.sleep(0.01)
        raise errors.InternalError(f"buffer {buffer_id} never appeared on this worker")


# The commands (by record type) whose handling needs the worker process, told and asked
# (`commands.py` says why each does); every other command is applied by its record.
_TOLD: dict[type, Callable[[CommandApplier, DeviceHost, Any], None]] = {
    c.Execute: CommandApplier._on_execute,
    c.Load: CommandApplier._on_load,
    c.DropExecutable: CommandApplier._on_drop,
    c.Refuse: CommandApplier._on_refuse,
    m.PutBegin: CommandApplier._on_put_begin,
    m.PutData: CommandApplier._on_put_data,
    m.PutWhole: CommandApplier._on_put_whole,
    m.PutObjects: CommandApplier._on_put_objects,
    m.PutFile: CommandApplier._on_put_file,
    m.FetchFile: CommandApplier._on_fetch_file,
}
_ASKED: dict[type, Callable[[CommandApplier, DeviceHost, int, Any], None]] = {
    c.Compile: CommandApplier._on_compile,
    c.ProgramText: CommandApplier._on_describe,
    c.CostAnalysis: CommandApplier._on_describe,
    c.Fetch: CommandApplier._on_fetch,
    c.Pull: CommandApplier._on_pull,
}
