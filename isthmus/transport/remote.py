"""The controller's end of a worker process: `WorkerChannel` over a message stream.

Fire-and-forget commands are collected and sent as one `Batch` per event-loop turn, so one
client request costs one message per involved worker however many commands it makes.
Requests (`commands.Request`) get a number and resolve when the worker answers.
When the worker is lost every pending request fails with the loss, and later commands are
dropped: the controller has already poisoned the buffers they would touch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import numpy as np

from isthmus import errors
from isthmus.hostmem import (
    Assembly,
    backing_file,
    byte_view,
    map_file,
    remove_quietly,
    write_file,
)
from isthmus.ids import BufferId, WorkerId
from isthmus.transport import auth
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.base import Commands, WorkerChannel
from isthmus.transport.flow import FlowGate
from isthmus.transport.frames import Parts

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# What a worker answers to a FetchFile: the buffer's dtype name and shape.
_Written = tuple[str, tuple[int, ...]]

FREE_DELAY = 0.002  # seconds a free waits for other commands to travel with
SHARED_BYTES = 1 << 20  # with a worker on this machine, data this large goes through files


class RemoteWorker:
    """A worker process, seen from the controller."""

    local = False  # `WorkerChannel.local`

    def __init__(self, slot: WorkerId, register: m.Register,
                 send: Callable[[bytes | Parts], None],
                 peer: str, close: Callable[[], None] = lambda: None,
                 flow: FlowGate | None = None, token: str = "") -> None:
        self.slot = slot
        self.token = token  # names this membership in the worker's pulses
        self.data_key = secrets.token_hex(32)  # of its data server, this membership
        self.register = register
        self.peer = peer
        self._send = send
        self._close = close
        self.forming = False  # in a group formation: silence is expected, not a loss
        self._pending: list[c.Told] = []
        self._pending_weight = 0
        # Flow control: weight of the commands sent, and of those the worker has applied.
        self._flow = flow
        self.sent = 0
        self.applied = 0
        # The scheduled flush, if any: a TimerHandle while only frees wait (FREE_DELAY).
        self._flush: asyncio.Handle | None = None
        self._held = False  # while the collective group re-forms, commands wait
        self._requests = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[object]] = {}
        self._fetches: dict[int, _Incoming] = {}
        self.last_seen = time.monotonic()
        self.reported: dict[str, int] = {}
        # How the worker names itself in the controller's log (the manager sets it when it
        # welcomes the worker), and the file its output goes to.
        self.name = f"{register.hostname}:{register.pid}"
        # What its heartbeats say of its command loop: messages read and not yet applied,
        # and what the command being applied waits for ("": none is).
        self.queued = 0
        self.applying = ""
        # Since when it has held commands it applies none of while it waits for nothing
        # (its command loop stopped: a bug, `stalled`), its progress then, and the last
        # heartbeat that said so.
        self._stalled_since: float | None = None
        self._stalled_at = -1
        self._stalled_heard = 0.0
        self.leaving = ""  # why the worker said it leaves (`Leaving`), for its loss
        self.lost: errors.IsthmusError | None = None
        # (shared directory, probe file) offered in the Welcome; the directory is used once
        # the worker has shown that it reads it (`shared_dir`).
        self.probe: tuple[str, str] | None = None
        self.shared_dir: str | None = None
        self._files = itertools.count()

    @property
    def data_address(self) -> str:
        return self.register.data_address

    def pull_mac(self, buffer_id: int) -> bytes:
        """What a peer's request for this worker's buffer `buffer_id` must carry."""
        return auth.fetch_mac(self.data_key, buffer_id)

    # ---- sending -------------------------------------------------------------------------

    def _command(self, command: c.Told, urgent: bool = True, weight: int = 1) -> None:
        """Queues a command for this turn's batch. A command that is not urgent (a free)
        waits up to FREE_DELAY for company, so it rides with the next batch."""
        if self.lost is not None:
            return
        self._pending.append(command)
        self._pending_weight += weight
        if self._flush is not None:
            if not urgent or not isinstance(self._flush, asyncio.TimerHandle):
                return  # what is scheduled is soon enough
            self._flush.cancel()
        loop = asyncio.get_running_loop()
        self._flush = (loop.call_soon(self.flush) if urgent else
                       loop.call_later(FREE_DELAY, self.flush))

    def flush(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._pending and self.lost is None and not self._held:
            batch, self._pending = tuple(self._pending), []
            self._sent(self._pending_weight)
            self._pending_weight = 0
            self._send(m.encode(m.Batch(batch)))

    def _sent(self, weight: int) -> None:
        self.sent += weight
        if self._flow is not None and self.sent - self.applied >= self._flow.limits.high:
            self._flow.report(self.slot, self.sent - self.applied)

    @property
    def backlog(self) -> int:
        """Weight of the commands sent that the worker has not applied yet."""
        return self.sent - self.applied

    def send_now(self, message: object) -> None:
        """Sends a message outside the batches (after whatever is queued)."""
        self.flush()
        if self.lost is None:
            self._send(m.encode(message))

    def hold(self) -> None:
        """Keeps later commands back (they belong to the next collective group)."""
        self._held = True

    def release(self) -> None:
        self._held = False
        self.flush()

    def request(self) -> tuple[int, asyncio.Future[Any]]:
        """A request number and the future its Reply resolves (to what the caller's message
        asked for)."""
        return self._request()

    def _request(self) -> tuple[int, asyncio.Future[object]]:
        number = next(self._requests)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            future.set_exception(self.lost)
        else:
            self._waiting[number] = future
        return number, future

    # ---- receiving -----------------------------------------------------------------------

    def on_message(self, message: object) -> None:
        self.last_seen = time.monotonic()
        if isinstance(message, m.Applied):
            self.applied = message.total
            if self._flow is not None:
                self._flow.report(self.slot, self.sent - self.applied)
        elif isinstance(message, m.Heartbeat):
            self.reported = message.stats
            if message.applied > self.applied:  # what `Applied` left unreported
                self.applied = message.applied
                if self._flow is not None:
                    self._flow.report(self.slot, self.sent - self.applied)
            self.queued, self.applying = message.queued, message.applying
            if message.queued and not message.applying and self.backlog > 0:
                if self._stalled_since is None or self._stalled_at != message.applied:
                    self._stalled_since, self._stalled_at = self.last_seen, message.applied
                self._stalled_heard = self.last_seen
            else:
                self._stalled_since = None
        elif isinstance(message, m.Incident):
            self._log_incident(message)
        elif isinstance(message, m.Leaving):
            self.leaving = message.reason
        elif isinstance(message, m.SharedDir):
            if self.probe is not None and message.path == self.probe[0]:
                self.shared_dir = message.path
                remove_quietly(self.probe[1])
        elif isinstance(message, m.FetchHeader):
            self._fetches[message.request] = _Incoming(message)
        elif isinstance(message, m.Data):
            incoming = self._fetches.get(message.request)
            if incoming is not None:
                incoming.write(message.offset, message.data)
        elif isinstance(message, m.Reply):
            future = self._waiting.pop(message.request, None)
            incoming = self._fetches.pop(message.request, None)
            if future is None or future.done():
                return
            if message.error is not None:
                future.set_exception(_as_error(message.error))
            elif incoming is not None:
                future.set_result(incoming.array())
            else:
                future.set_result(message.value)
        else:
            logger.warning("worker %s sent an unexpected %s", self.slot, type(message).__name__)

    def stalled(self, now: float) -> float:
        """Seconds for which the worker's heartbeats have said that it holds commands it
        applies none of while nothing it applies waits (0: they have not).

        Only heartbeats count, up to the last one: a stopped command loop leaves the
        worker's event loop free to send them, while a loop busy applying a long run of
        commands sends none until it yields. Before this, the last heartbeat's word was
        taken for all the time after it, and a worker that applied a backlog of thousands
        of steps in one go on a loaded machine was declared lost for a stall."""
        if self._stalled_since is None:
            return 0.0
        return min(now, self._stalled_heard) - self._stalled_since

    def _log_incident(self, incident: m.Incident) -> None:
        """An error the worker logged, in the controller's log with the worker's name."""
        level = logging.getLevelName(incident.level)
        where = f"; its log: {self.register.log}" if self.register.log else ""
        dropped = (f" ({incident.dropped} more errors before this one are only in its log)"
                   if incident.dropped else "")
        logger.log(level if isinstance(level, int) else logging.ERROR,
                   "worker %s (%s%s): %s%s%s", self.name, incident.source, where,
                   incident.message, dropped,
                   f"\n{incident.traceback.rstrip()}" if incident.traceback else "")

    def mark_lost(self, error: errors.IsthmusError) -> None:
        """The worker is gone: every pending request fails with `error`, and its stream is
        closed (a worker that is in fact alive then registers afresh)."""
        if self.lost is None:
            self.lost = error
            self._close()
            if self._flow is not None:
                self._flow.forget(self.slot)
            if self.probe is not None and self.shared_dir is None:
                remove_quietly(self.probe[1])  # never answered (another machine): not needed now
        self._pending.clear()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
                future.exception()
        self._fetches.clear()

    # ---- WorkerChannel -------------------------------------------------------------------

    def send(self, command: c.Command) -> None:
        self._command(command, urgent=not isinstance(command, c.Free))

    def ask(self, request: c.Request[_T]) -> Awaitable[_T]:
        if isinstance(request, c.Put):
            return cast(Awaitable[_T], self._put(request))
        number, future = self._request()
        if (isinstance(request, c.Fetch) and self.shared_dir is not None
                and request.nbytes >= SHARED_BYTES):
            path = self._file("fetch")
            self._command(m.FetchFile(number, request.buffer, path))
            return cast(Awaitable[_T], _mapped(path, future))
        self._command(m.Ask(number, request))
        return cast(Awaitable[_T], future)

    def _put(self, put: c.Put) -> Awaitable[None]:
        """A put's data travels through a file (a worker on this machine), as objects (a
        string array) or in pieces on the stream."""
        value = put.value
        if (self.shared_dir is not None and value.dtype != object
                and value.nbytes >= SHARED_BYTES):
            path = self._file("put")
            try:
                # An upload received into a file here, or a file the client wrote into the
                # shared directory: the worker maps the very same pages.
                if not _linked(backing_file(value), path):
                    write_file(path, value)
            except OSError as e:
                logger.warning("writing %s failed (%s); data to worker %s streams from now on",
                               path, e, self.slot)
                self.shared_dir = None
                remove_quietly(path)
            else:
                number, future = self._request()
                self._command(m.PutFile(number, put.buffer, put.device, put.memory_kind,
                                        m.dtype_name(value.dtype), tuple(value.shape), path))
                return _removing(path, future)
        number, future = self._request()
        if value.dtype == object:
            self._command(m.PutObjects(number, put.buffer, put.device, value))
            return cast(Awaitable[None], future)
        raw = memoryview(byte_view(value))
        if len(raw) <= m.PIECE_BYTES:  # one message: the usual shard of a batch
            whole = m.PutWhole(number, put.buffer, put.device, put.memory_kind,
                               m.dtype_name(value.dtype), tuple(value.shape), m.Bulk(raw))
            self._command(whole, weight=m.weight(whole))
            return cast(Awaitable[None], future)
        self._command(m.PutBegin(put.buffer, put.device, put.memory_kind,
                                 m.dtype_name(value.dtype), tuple(value.shape), len(raw)))
        offset = 0
        while True:
            piece = raw[offset:offset + m.PIECE_BYTES]
            last = offset + len(piece) >= len(raw)
            data = m.PutData(number, put.buffer, offset, m.Bulk(piece), last)
            self._command(data, weight=m.weight(data))
            offset += len(piece)
            if last:
                break
        return cast(Awaitable[None], future)

    def relay(self, buffer: BufferId, to: WorkerChannel, dst: BufferId, device: int,
              memory_kind: str | None) -> Awaitable[None] | None:
        """Moves a buffer of this worker to worker `to` through a file of the controller's
        shared directory, when both run on the controller's machine (they answered its
        probe): this worker writes it (`FetchFile`), then `to` maps and stores it
        (`PutFile`). None when that is not possible; the caller then pulls over the
        peers' data servers. Numeric buffers only (string arrays do not travel in files)."""
        if (self.shared_dir is None or getattr(to, "shared_dir", None) is None
                or self.lost is not None):
            return None
        peer = cast(RemoteWorker, to)  # only a worker process's channel has a shared directory
        if peer.lost is not None:
            return None
        path = self._file("relay")
        number, written = self._request()
        self._command(m.FetchFile(number, buffer, path))

        async def store() -> None:
            try:
                dtype, shape = cast(_Written, await written)
                number, stored = peer._request()
                peer._command(m.PutFile(number, dst, device, memory_kind, dtype,
                                        tuple(shape), path))
                await stored
            finally:
                remove_quietly(path)

        return store()

    def deliver(self, commands: Commands, more: bool = False) -> None:
        """Shared commands are encoded once for all their workers; a worker with nothing
        else queued gets the very same frame, sent at once (unless `more` comes)."""
        if self.lost is not None:
            return
        if commands.encoded is None:
            # Shared commands (Execute, Free) carry no Bulk bytes: they encode to one bytes
            # object.
            shared = m.Shared(cast(bytes, m.encode(tuple(commands.items))))
            commands.encoded = (shared, m.encode(m.Batch((shared,))))
        shared, frame = commands.encoded
        if not self._pending and not self._held and not more:
            self._sent(len(commands.items))
            self._send(frame)
        else:
            self._command(shared, weight=len(commands.items))

    def _file(self, kind: str) -> str:
        assert self.shared_dir is not None
        return os.path.join(self.shared_dir, f"{kind}-{self.slot}-{os.getpid()}-"
                                             f"{next(self._files)}")

    def stats(self) -> dict[str, int]:
        return dict(self.reported)


def _linked(source: str | None, path: str) -> bool:
    """`path` is made a second name of `source` (False: there is none, or it cannot be
    linked there, e.g. on another file system: the bytes are then copied)."""
    if source is None:
        return False
    try:
        os.link(source, path)
    except OSError:
        return False
    return True


async def _removing(path: str, answer: Awaitable[object]) -> None:
    """Waits for the worker's answer to a PutFile; the file goes either way."""
    try:
        await answer
    finally:
        remove_quietly(path)


async def _mapped(path: str, answer: Awaitable[object]) -> np.ndarray:
    """The buffer a worker wrote into `path` for a FetchFile, mapped without a copy."""
    try:
        dtype, shape = cast(_Written, await answer)
        return map_file(path, read_only=True).view(m.dtype_of(dtype)).reshape(shape)
    finally:
        remove_quietly(path)


class _Incoming:
    """A fetched buffer arriving in pieces (`FetchHeader`, then `Data`)."""

    __slots__ = ("header", "pieces")

    def __init__(self, header: m.FetchHeader) -> None:
        self.header = header
        self.pieces = Assembly(header.nbytes)

    def write(self, offset: int, data: m.Bulk | memoryview) -> None:
        self.pieces.add(offset, data)

    def array(self) -> np.ndarray:
        return self.pieces.value(m.dtype_of(self.header.dtype), self.header.shape)


def _as_error(error: object) -> errors.IsthmusError:
    if isinstance(error, errors.IsthmusError):
        return error
    return errors.InternalError(f"a worker failed unexpectedly: {error}")
