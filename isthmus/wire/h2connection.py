"""One client connection of the h2 client port (`h2server`): HTTP/2 events in, a task per
call, frames out.

h2 (python-hyper) keeps the connection's HTTP/2 state; this module frames gRPC messages (a
5-byte prefix each), maps metadata and statuses, and writes each event-loop turn's frames to
the socket at once. The bytes between the socket and h2, and the copies a large transfer
does not make, are in `h2frames`; calls whose messages go straight to a sink, and uploads
opened below h2 (*bare* streams), in `h2direct`.

Flow control: a stream's received bytes are handed back to the client only when its handler
takes the next message (or at once while no whole message waits, so that a message larger
than the window completes), so a session that is not read blocks the client's writes (as
the grpc.aio server's small lookahead does); the connection window is large, so one stalled
stream never stalls the host-buffer uploads beside it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
import h2.config
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from isthmus.compat.h2 import Held
from isthmus.transport.frames import keep_alive
from isthmus.wire.h2calls import (
    STREAM_WINDOW,
    Abort,
    Call,
    Context,
    metadata,
    percent_encode,
    whole,
)
from isthmus.wire.h2direct import Direct
from isthmus.wire.h2frames import LARGE, Frames, Wire, window_update
from isthmus.wire.methods import MAX_MESSAGE, Answer, Batch, Method, Pieces, Refused

if TYPE_CHECKING:
    from isthmus.frontend.lease_service import Identity
    from isthmus.wire.peers import Ticket

logger = logging.getLogger(__name__)

UPLOAD_WINDOW = 8 << 20  # ... on a stream whose handler reads as it goes (uploads)
CONNECTION_WINDOW = (1 << 31) - 1 - 65535  # the most HTTP/2 allows, beyond the initial one
MAX_FRAME = (1 << 24) - 1  # the largest DATA frame a client may send us
WRITE_HIGH = 8 << 20  # bytes queued on the socket at which a sender waits
MAX_STREAMS = 1 << 20
REFUSED_CLOSE_SECONDS = 0.5  # a stranger over its rate is closed this long after


class Connection:
    """One client connection: HTTP/2 events in, handler tasks, frames out."""

    def __init__(self, methods: dict[str, Method], max_message: int = MAX_MESSAGE) -> None:
        self.methods = methods
        self.max_message = max_message  # bytes of one gRPC message; larger ones are refused
        self.h2: Frames  # made once the client speaks (`_speak`)
        self.wire = Wire(self._speak, self._made, self._events, WRITE_HIGH)
        self.wire.open_bare, self.wire.reset_bare = self._open_bare, self._reset_bare
        self.wire.take_window = self._take_window
        self.streams: dict[int, Call] = {}
        self.window_waiters: list[asyncio.Future[None]] = []
        self._flush_scheduled = False
        self.direct = Direct(self)
        self.peer = "ipv4:?:0"
        self.identity: Identity | None = None  # a shared service's gate says who it is
        # A shared service's connection without identity: its peer's limits and deadline
        # (`wire/peers.py`), until a worker's pulse proves it (`Context.prove`).
        self.ticket: Ticket | None = None
        self._closing = False  # over its peer's rate: closed in REFUSED_CLOSE_SECONDS

    def _made(self, transport: asyncio.Transport) -> None:
        keep_alive(transport, idle=30, interval=10, count=2)  # notice clients that vanished
        host, port = (transport.get_extra_info("peername") or ("?", 0))[:2]
        self.peer = f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
        if self.ticket is not None:
            self.ticket.watch(self._expired)

    def _speak(self) -> Frames:
        """h2's state, once the client sends more than its preface (a connection that stays
        silent holds none), and our side of the preface."""
        # Our own headers are written normalized (lower-case bytes, no pseudo-header after
        # another field): h2's checks of them cost a third of each send_headers.
        self.h2 = h2c = Frames(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=False,
            validate_outbound_headers=False, normalize_outbound_headers=False,
            split_outbound_cookies=False))
        # Our settings hold from the first byte, not only once the client acknowledges
        # them: grpc's client may send frames of the new size before its acknowledgement.
        h2c.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            # The client uploads every shard of a put on a stream of its own, thousands at
            # once for a pmap over many arguments.
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: h2c.DEFAULT_MAX_HEADER_LIST_SIZE})
        h2c.max_inbound_frame_size = MAX_FRAME
        h2c.initiate_connection()
        h2c.increment_flow_control_window(CONNECTION_WINDOW)
        self.schedule_flush()
        return h2c

    def _expired(self) -> None:
        logger.debug("closed a connection from %s that did not say who it is", self.peer)
        self.close()

    def _prove(self) -> None:
        """The connection is a fleet worker's (its pulse was recognized): no stranger."""
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None

    def _events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            self._on(event)
        self.schedule_flush()

    async def run(self) -> None:
        """Until the client's connection closes; then its calls are cancelled."""
        try:
            await self.wire.closed
        finally:
            for stream in list(self.streams.values()):
                if stream.task is not None:
                    stream.task.cancel()
                if stream.sink is not None:
                    self.direct.cancel(stream, ConnectionResetError("the connection closed"))
            self._wake_senders()
            if self.ticket is not None:
                self.ticket.release()
            if self.wire.transport is not None:
                self.wire.transport.close()

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._start(event.stream_id, event.headers)
        elif isinstance(event, h2.events.DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is None or stream.task is None or stream.task.done():
                self.acknowledge(event.stream_id, event.flow_controlled_length)
                return
            try:
                stream.feed(event.data, event.flow_controlled_length)
            except Abort as e:
                stream.task.cancel()
                self.trailers(stream, e.code, e.message)
                self.stop_sending(stream)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.end()
                cut = stream.cut_short()
                if cut is not None and stream.task is not None:
                    stream.task.cancel()
                    self.trailers(stream, cut.code, cut.message)
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None and stream.task is not None:
                stream.task.cancel()
            if stream is not None and stream.sink is not None:
                self.direct.cancel(stream, ConnectionResetError("the client reset the call"))
            self._wake_senders()
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._wake_senders()

    def _open_bare(self, stream_id: int, block: memoryview) -> bool:
        """An upload opened below h2 (a *bare* stream): its HEADERS frame decoded here when
        it leaves HPACK's table alone (the stock client's uploads after its first), the
        stream served as a direct one whose answer and trailers are written as raw frames.
        h2 only counts the id as used. A third of the server's time on small sharded puts
        went to h2's handling of these frames. False: h2 takes the frame."""
        if len(self.streams) >= MAX_STREAMS or self.h2.remote_settings.initial_window_size < 5:
            return False
        headers = self.h2.decoder.read_only(bytes(block))
        if headers is None:
            return False
        path = next((v for k, v in headers if k == b":path"), b"").decode(errors="replace")
        method = self.methods.get(path)
        if (method is None or method.sink is None or method.kind != "stream_unary"
                or not self.h2.claim_stream(stream_id)):
            return False
        self._start(stream_id, headers, method, bare=True)
        self.schedule_flush()
        return True

    def _take_window(self, stream_id: int, increment: int) -> bool:
        """A WINDOW_UPDATE frame below h2 (the client sends one or two per upload)."""
        if not self.h2.take_window_update(stream_id, increment):
            return False
        if not stream_id and self.window_waiters:
            self._wake_senders()
        return True

    def _reset_bare(self, stream_id: int) -> None:
        """The client reset a direct stream; h2 says so itself for one it opened."""
        stream = self.streams.get(stream_id)
        if stream is None:  # answered: its last bytes were being drained
            self.wire.direct.pop(stream_id, None)
        elif stream.bare:
            del self.streams[stream_id]
            if stream.task is not None:
                stream.task.cancel()
            self.direct.cancel(stream, ConnectionResetError("the client reset the call"))

    def _start(self, stream_id: int, headers: list[tuple[bytes, bytes]],
               method: Method | None = None, bare: bool = False) -> None:
        if method is None:
            path = next((v for k, v in headers if k == b":path"), b"").decode(errors="replace")
            method = self.methods.get(path)
        stream = Call(self, stream_id, method or Method("unary_unary", _unknown))
        stream.bare = bare
        self.streams[stream_id] = stream
        ticket = self.ticket
        if ticket is not None and not ticket.spend():
            self.trailers(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "too many calls without credentials from this address (the "
                          "service's --peer-requests); the connection is closed")
            if not self._closing:  # soon, not at once: the client reads why first
                self._closing = True
                asyncio.get_running_loop().call_later(REFUSED_CLOSE_SECONDS, self.close)
            return
        if method is None:
            self.trailers(stream, grpc.StatusCode.UNIMPLEMENTED,
                           f"method {path} is not served here")
            return
        context = Context(metadata(headers), self.peer, self.identity,
                          prove=self._prove if ticket is not None else None,
                          local=ticket is None or ticket.local)
        if method.sink is not None:
            self.direct.start(stream, method, context)
            size = getattr(stream.sink, "size", None)
            if method.kind == "stream_unary" and stream.sink is not None and (
                    size is None or size + 5 > STREAM_WINDOW):
                self._widen(stream)
            return
        if method.kind == "stream_unary":
            self._widen(stream)
        stream.task = asyncio.get_running_loop().create_task(self._serve(stream, context))

    def _widen(self, stream: Call) -> None:
        """An upload's window: its handler reads as the bytes come."""
        if stream.bare:
            self.h2.raw(window_update(stream.id, UPLOAD_WINDOW - STREAM_WINDOW))
        else:
            self.h2.increment_flow_control_window(UPLOAD_WINDOW - STREAM_WINDOW, stream.id)
        stream.window = UPLOAD_WINDOW

    async def answer_bare(self, stream: Call, framed: bytes) -> None:
        """A bare stream's answer, once the connection's window has room for it."""
        while stream.id in self.streams:
            if self.h2.respond_closed(stream.id, framed, bare=True):
                del self.streams[stream.id]
                self.schedule_flush()
                return
            self.flush()
            await self._window()

    async def _serve(self, stream: Call, context: Context) -> None:
        method = stream.method
        request: object  # a message, or a stream's async iterator of them
        if method.kind.startswith("unary"):
            try:
                first = await stream.next()
            except asyncio.CancelledError:
                return
            if first is None:
                self.trailers(stream, grpc.StatusCode.INTERNAL,
                               "the call sent no request message")
                return
            try:
                request = method.deserialize(whole(first)) if method.deserialize else whole(first)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError, or worse
                self.trailers(stream, grpc.StatusCode.INVALID_ARGUMENT,
                               f"the request message of {method.fn.__name__} is malformed")
                return
        else:
            request = stream.messages()
        await self.answer(stream, method.fn(request, context))

    async def answer(self, stream: Call, answer: Answer) -> None:
        """Sends a handler's answer (a coroutine of the response, or an async iterator of
        responses, or a response itself), then the trailers with its outcome."""
        try:
            if hasattr(answer, "__aiter__"):
                try:
                    async for response in answer:
                        await self._send(stream, response)
                finally:
                    await answer.aclose()  # its cleanup runs now, not when collected
            else:
                response = await answer if asyncio.iscoroutine(answer) else answer
                if response is not None:
                    await self._send(stream, response)
            self.trailers(stream, grpc.StatusCode.OK, "")
        except (Abort, Refused) as e:
            self.trailers(stream, e.code, e.message)
        except (asyncio.CancelledError, ConnectionError, h2.exceptions.StreamClosedError):
            pass  # the client went away, or reset this call
        except Exception:
            logger.exception("%s failed", stream.method.fn.__name__)
            self.trailers(stream, grpc.StatusCode.INTERNAL,
                           "the server failed unexpectedly; see its log")

    async def _send(self, stream: Call, message: Answer) -> None:
        """One message, or a `Batch` of them, each behind its 5-byte prefix: what is small
        goes joined into one DATA frame, a large piece is sent without a copy."""
        pieces: list[bytes | memoryview] = []
        serialize = stream.method.serialize
        for one in message if isinstance(message, Batch) else (message,):
            parts = (list(one) if isinstance(one, Pieces) else
                     [serialize(one) if serialize is not None else one])
            pieces.append(b"\0" + sum(len(p) for p in parts).to_bytes(4, "big"))
            pieces += parts
        if stream.id not in self.streams:
            raise asyncio.CancelledError
        if not stream.headers_sent:
            self.h2.send_headers(stream.id, [(b":status", b"200"),
                                             (b"content-type", b"application/grpc")])
            stream.headers_sent = True
        if sum(len(p) for p in pieces) <= LARGE:
            await self._send_data(stream, memoryview(b"".join(pieces)))
        else:
            small: list[bytes | memoryview] = []
            for piece in pieces:
                if len(piece) > LARGE:
                    if small:
                        await self._send_data(stream, memoryview(b"".join(small)))
                        small = []
                    await self._send_data(stream, memoryview(piece))
                else:
                    small.append(piece)
            if small:
                await self._send_data(stream, memoryview(b"".join(small)))
        self.schedule_flush()
        if self.wire.buffered() > WRITE_HIGH:
            self.flush()
            await self.wire.drain()

    async def _send_data(self, stream: Call, data: memoryview) -> None:
        while data:
            room = min(self.h2.local_flow_control_window(stream.id),
                       self.h2.max_outbound_frame_size, len(data))
            if room <= 0:
                self.flush()
                await self._window()
                if stream.id not in self.streams:
                    raise asyncio.CancelledError
                continue
            if room > LARGE:
                # h2 takes only the length of Held bytes; its annotation wants bytes.
                self.h2.send_data(stream.id, Held(data[:room]))  # type: ignore[arg-type]
                self.flush()  # a large frame goes out now
            else:
                self.h2.send_data(stream.id, data[:room])
            data = data[room:]

    def trailers(self, stream: Call, code: grpc.StatusCode, message: str) -> None:
        self.wire.direct.pop(stream.id, None)  # what still comes goes to h2
        if self.streams.pop(stream.id, None) is None:
            return
        fields = [(b"grpc-status", str(code.value[0]).encode())]
        if message:
            fields.append((b"grpc-message", percent_encode(message)))
        if stream.bare:
            self.h2.bare_trailers(stream.id, fields, stream.headers_sent)
            if not stream.ended:
                self.direct.drain(stream)
            self.schedule_flush()
            return
        if not stream.headers_sent:
            fields = [(b":status", b"200"), (b"content-type", b"application/grpc"), *fields]
        try:
            self.h2.send_headers(stream.id, fields, end_stream=True)
        except h2.exceptions.StreamClosedError:
            return
        if stream.unacked:
            self.acknowledge(stream.id, stream.unacked)
        self.schedule_flush()

    def stop_sending(self, stream: Call) -> None:
        """After the answer to a call whose client still sends: RST_STREAM (NO_ERROR) asks
        it to stop (RFC 9113, 8.1), instead of taking the rest of a refused message."""
        if not stream.ended:
            if stream.bare:
                self.h2.bare_reset(stream.id, h2.errors.ErrorCodes.NO_ERROR)
                self.schedule_flush()
                return
            try:
                self.h2.reset_stream(stream.id, h2.errors.ErrorCodes.NO_ERROR)
            except h2.exceptions.ProtocolError:
                return
            self.schedule_flush()

    def acknowledge(self, stream_id: int, size: int) -> None:
        try:
            self.h2.acknowledge_received_data(size, stream_id)
        except h2.exceptions.StreamClosedError:
            self.h2.increment_flow_control_window(size)
        self.schedule_flush()

    async def _window(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.window_waiters.append(waiter)
        await waiter

    def _wake_senders(self) -> None:
        waiters, self.window_waiters = self.window_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        out = self.h2.take()
        for data in (out if len(out) < 2 else coalesce(out)):
            self.wire.write(data)

    def close(self) -> None:
        try:
            if self.wire.speaking:
                self.h2.close_connection()
                self.flush()
        except h2.exceptions.ProtocolError:
            pass
        if self.wire.transport is not None:
            self.wire.transport.close()


SMALL_WRITE = 64 << 10  # pieces up to this size are joined into one write


def coalesce(pieces: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """The same bytes in fewer pieces: runs of small ones joined (one send for the answers
    of a turn instead of one per frame), large ones kept as they are (not copied)."""
    out: list[bytes | memoryview] = []
    run: list[bytes | memoryview] = []
    for piece in pieces:
        if len(piece) <= SMALL_WRITE:
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run) if len(run) > 1 else run[0])
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


async def _unknown(request: object, context: Context) -> None:
    return None
