"""The bytes under `h2server`: HTTP/2 frames between the socket and h2's state machine,
with the bulk of a transfer never copied in Python.

h2 (python-hyper) keeps the protocol's state, but moves bytes as a library for small
messages would: a received frame is appended to a buffer, sliced out of it and copied again
into its event, and a sent frame is joined into a send buffer that is copied once more on
the way out. For a 256 MiB put or fetch that was most of the server's CPU. Here:

- *Receiving* (`Wire`): the socket is read into a buffer of ours. DATA frames are parsed
  here and given to h2 as frames (a small one copied out once); the body of a large one is
  read from the socket straight into a buffer of its own, which becomes the message the
  handler gets (or one of its `Pieces`) without another copy. Other frames go to h2 as
  bytes. The DATA frames of a *direct* stream (an upload whose handler is a sink,
  `Method.sink`) do not reach h2 at all: h2 opens the stream and closes it, the bytes in
  between go to the sink, and their flow control is ours (`window_update`).
- *Sending* (`Frames`, `Held`): a large DATA frame's bytes are handed to h2 wrapped in
  `Held`, so that h2 counts them for flow control without copying them, and are written to
  the socket as the frame's 9-byte header and the caller's own view.

Everything else (settings, headers, windows, small messages) goes through h2 unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import cast

import h2.config
import h2.errors
import h2.events
import h2.exceptions
import hyperframe.exceptions
import numpy as np

from isthmus.compat.h2 import Connection
from isthmus.transport.frames import read_room
from isthmus.wire import hpackfast

logger = logging.getLogger(__name__)

LARGE = 1 << 16  # DATA frames above this many bytes are not copied (either way)
# A HEADERS or CONTINUATION frame over this is refused (ENHANCE_YOUR_CALM): four times the
# header list we allow (h2's 64 KiB), so that h2's backlog of 64 frames of one header block
# holds 16 MiB at most, not a GiB.
MAX_HEADER_FRAME = 1 << 18
READ_BUFFER = 1 << 18  # what one read of the socket may take, besides a large frame's body
# ... until a read fills this much: an idle connection (say, one that sent only its preface)
# holds a few KiB, not READ_BUFFER (issue 47: 20,000 of them took 3.7 GiB).
FIRST_READ = 1 << 10
PREFACE = len(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # the client's first bytes
_HEADER = struct.Struct(">HBBBL")  # length (24 bits), type, flags, stream id
_INCREMENT = struct.Struct(">L")  # a WINDOW_UPDATE frame's body
DATA, HEADERS, RST_STREAM, WINDOW_UPDATE, CONTINUATION = 0x0, 0x1, 0x3, 0x8, 0x9  # frame types
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20  # flags
# Header blocks in HPACK that neither read nor change the dynamic table (RFC 7541: an
# indexed static field, and literals without indexing): ":status: 200" and "content-type:
# application/grpc"; "grpc-status: 0".
_RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
_OK_TRAILERS = b"\x00\x0bgrpc-status\x010"


def _frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return _HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


class Frames(Connection):
    """h2's connection state (through `compat.h2.Connection`), which writes the DATA frames
    of `Held` bytes as their header and the caller's view, in order with the frames it
    serializes, takes large DATA frames that `Wire` parsed, and answers direct streams."""

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        decoder = hpackfast.Decoder()  # before any header block: the same (empty) state
        decoder.max_header_list_size = self.decoder.max_header_list_size
        decoder.max_allowed_table_size = self.decoder.max_allowed_table_size
        self.decoder: hpackfast.Decoder = decoder

    def held(self, stream_id: int, view: memoryview, end_stream: bool) -> None:
        self.raw(_frame_header(len(view), DATA, END_STREAM if end_stream else 0, stream_id))
        self.out.append(view)

    def respond_closed(self, stream_id: int, message: bytes, bare: bool = False) -> bool:
        """Ends a stream whose request h2 has not seen end (a direct stream) with a whole
        gRPC response: headers, `message` (already framed) and OK trailers, written here
        (encoded without h2's header table, so its state is untouched); h2 forgets the
        stream as if it had closed it. False, and nothing done, when the stream's or the
        connection's window has no room for `message`. A `bare` stream is one h2 never
        opened (`claim_stream`): its window is the client's initial one."""
        room = (min(self.outbound_flow_control_window, self.remote_settings.initial_window_size)
                if bare else self.local_flow_control_window(stream_id))
        if room < len(message):
            return False
        self.outbound_flow_control_window -= len(message)
        self.raw(b"".join((
            _frame_header(len(_RESPONSE_HEADERS), HEADERS, END_HEADERS, stream_id),
            _RESPONSE_HEADERS,
            _frame_header(len(message), DATA, 0, stream_id), message,
            _frame_header(len(_OK_TRAILERS), HEADERS, END_HEADERS | END_STREAM, stream_id),
            _OK_TRAILERS)))
        if not bare:
            self.forget_stream(stream_id)
        return True

    def bare_trailers(self, stream_id: int, fields: list[tuple[bytes, bytes]],
                      headers_sent: bool) -> None:
        """The trailers that end a bare stream (`respond_closed`), with the response's
        headers if none were sent; every field a literal that h2's table never sees."""
        block = b"".join(b"\0" + _literal(name) + _literal(value[:MAX_STATUS_MESSAGE])
                         for name, value in fields)
        if not headers_sent:
            block = _RESPONSE_HEADERS + block
        self.raw(_frame_header(len(block), HEADERS, END_HEADERS | END_STREAM, stream_id)
                 + block)

    def bare_reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM on a bare stream."""
        self.raw(_frame_header(4, RST_STREAM, 0, stream_id) + code.to_bytes(4, "big"))


MAX_STATUS_MESSAGE = 4096  # bytes of a status message kept on a bare stream's trailers


def _literal(text: bytes) -> bytes:
    """An HPACK string, not Huffman-coded: its length (a 7-bit prefix integer), then it."""
    length = len(text)
    if length < 0x7F:
        return bytes((length,)) + text
    length -= 0x7F
    out = bytearray((0x7F,))
    while length >= 0x80:
        out.append(length & 0x7F | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + text


def violation(frames: Frames, error: type[h2.exceptions.ProtocolError], message: str
              ) -> h2.exceptions.ProtocolError:
    """A connection error found below h2 (raise it): its GOAWAY is queued, as h2 does for
    those it finds, and `Wire` writes it and closes."""
    frames.close_connection(error.error_code)
    return error(message)


def window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame, for bytes that h2 never saw (a direct stream's)."""
    return _frame_header(4, WINDOW_UPDATE, 0, stream_id) + increment.to_bytes(4, "big")


class Wire(asyncio.BufferedProtocol):
    """A connection's socket: frames read from it go to `frames`, and the events they make
    to `on_events`; writes wait (`drain`) while the socket's buffer is full."""

    def __init__(self, on_speak: Callable[[], Frames],
                 on_made: Callable[[asyncio.Transport], None],
                 on_events: Callable[[list[h2.events.Event]], None], high_water: int) -> None:
        self.on_speak, self.on_made, self.on_events = on_speak, on_made, on_events
        # h2's state (`on_speak`) is made once the client sends more than its preface: an
        # idle connection costs its buffer and this object, a few KiB.
        self.frames: Frames
        self.speaking = False
        self.high_water = high_water
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buf = bytearray(FIRST_READ)  # READ_BUFFER once a read fills it (`read_room`)
        self._start = self._end = 0  # the bytes of _buf not yet handed on
        self._preface = PREFACE  # bytes of the client's preface still to come
        self._body: memoryview | None = None  # a large DATA frame being read in place
        self._filled = 0
        self._body_of = (0, 0)  # its stream id and flags
        self._writable: asyncio.Future[None] | None = None
        # Streams whose DATA frames bypass h2: stream id -> handler(flags, body, flow
        # controlled length); their flow control is the handler's (see `window_update`).
        self.direct: dict[int, Callable[[int, memoryview | bytes, int], None]] = {}
        # The HEADERS frames that open a stream may be taken below h2 too: `open_bare(stream
        # id, header block)` says whether it took one (else h2 gets it), and `reset_bare`
        # hears the client's RST_STREAM on any direct stream.
        self.open_bare: Callable[[int, memoryview], bool] | None = None
        self.reset_bare: Callable[[int], None] | None = None
        # So may WINDOW_UPDATE frames: `take_window(stream id, increment)` says whether it
        # took one.
        self.take_window: Callable[[int, int], bool] | None = None

    # Reading.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self.high_water)  # type: ignore[attr-defined]
        self.on_made(self.transport)  # type: ignore[arg-type]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._filled:]
        self._buf, self._start, self._end = read_room(self._buf, self._start, self._end,
                                                      READ_BUFFER)
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._body is not None:
                self._filled += nbytes
                if self._filled == len(self._body):
                    body, self._body = self._body, None
                    self._data(*self._body_of, body, len(body))
                return
            self._end += nbytes
            self._split()
        except h2.exceptions.ProtocolError as e:
            logger.info("a client broke the HTTP/2 protocol: %s", e)
            self._close()  # with h2's GOAWAY
        except hyperframe.exceptions.HyperframeError as e:
            # A frame hyperframe cannot even parse (e.g. DATA on stream 0): h2 never saw it,
            # so the GOAWAY is ours to send.
            logger.info("a client sent a malformed HTTP/2 frame: %s", e)
            try:
                self.frames.close_connection(h2.errors.ErrorCodes.PROTOCOL_ERROR)
            except h2.exceptions.ProtocolError:
                pass
            self._close()

    def _close(self) -> None:
        """Writes what h2 has to say (its GOAWAY) now, then closes the connection."""
        if self.transport is None:
            return
        if self.speaking:
            for data in self.frames.take():
                self.transport.write(data)
        self.transport.close()

    def _data(self, stream_id: int, flags: int, body: memoryview | bytes, flow: int) -> None:
        """A whole DATA frame: to its direct stream's handler, or through h2."""
        direct = self.direct.get(stream_id)
        if direct is not None:
            direct(flags, body, flow)
        else:
            self.on_events(self.frames.receive_data_frame(stream_id, flags & END_STREAM, body))

    def _split(self) -> None:
        """Hands on the whole frames in the buffer, DATA frames parsed here (h2's own frame
        buffer would copy them twice more); a large DATA frame's body still to come is then
        read into a buffer of its own. Events go out as they are made: a stream h2 has just
        opened may take its DATA frames directly (`direct`)."""
        if not self.speaking:
            if self._end - self._start <= PREFACE:
                return  # nothing but (part of) its preface yet
            self.frames = self.on_speak()
            self.speaking = True
        buf, pos, end, frames = self._buf, self._start, self._end, self.frames
        view = memoryview(buf)
        if self._preface:
            take = min(self._preface, end - pos)
            self._preface -= take
            self.on_events(frames.receive_data(view[pos:pos + take]))
            pos += take
        whole = pos  # frames from here to pos are whole and go to h2 as they are
        while end - pos >= 9:
            high, low, kind, flags, stream = _HEADER.unpack_from(buf, pos)
            length = high << 8 | low
            stream &= 0x7FFFFFFF
            if kind != DATA or length > frames.max_inbound_frame_size or (
                    flags & PADDED and stream not in self.direct):
                if length > MAX_HEADER_FRAME and kind in (HEADERS, CONTINUATION):
                    raise violation(frames, h2.exceptions.DenialOfServiceError,
                                    f"a header frame of {length} bytes")
                if end - pos < 9 + length:
                    break
                if (kind == HEADERS and flags & (END_HEADERS | END_STREAM | PADDED | PRIORITY)
                        == END_HEADERS and self.open_bare is not None):
                    if whole < pos:  # what came before goes first
                        self.on_events(frames.receive_data(view[whole:pos]))
                        whole = pos
                    if self.open_bare(stream, view[pos + 9:pos + 9 + length]):
                        pos += 9 + length
                        whole = pos
                        continue
                elif kind == WINDOW_UPDATE and length == 4 and self.take_window is not None:
                    if whole < pos:
                        self.on_events(frames.receive_data(view[whole:pos]))
                        whole = pos
                    increment = _INCREMENT.unpack_from(buf, pos + 9)[0] & 0x7FFFFFFF
                    if self.take_window(stream, increment):
                        pos += 13
                        whole = pos
                        continue
                elif kind == RST_STREAM and stream in self.direct and self.reset_bare:
                    self.reset_bare(stream)  # h2 gets it too (for a bare stream: a no-op)
                pos += 9 + length
                continue
            have = min(length, end - pos - 9)
            if have < length and (length <= LARGE or flags & PADDED):
                break  # a small (or padded) frame: once it is all here
            if whole < pos:
                self.on_events(frames.receive_data(view[whole:pos]))
            if flags & PADDED:  # only on a direct stream
                pad = buf[pos + 9] if length else length + 1
                if pad >= length:
                    raise violation(frames, h2.exceptions.ProtocolError,
                                    "DATA frame padding exceeds its length")
                body: memoryview | bytes = view[pos + 10:pos + 9 + length - pad].tobytes()
                pos += 9 + length
                whole = pos
                self._data(stream, flags & ~PADDED, body, length)
                continue
            if length > LARGE:
                body = memoryview(np.empty(length, np.uint8))  # no zeroing: all is read
                body[:have] = view[pos + 9:pos + 9 + have]
            else:
                body = view[pos + 9:pos + 9 + length].tobytes()
            pos += 9 + have
            whole = pos
            if have < length:  # the rest comes from the socket straight into it
                # Only a large frame is read in pieces: body is its memoryview.
                self._body, self._filled = cast(memoryview, body), have
                self._body_of = (stream, flags)
                break
            self._data(stream, flags, body, length)
        if whole < pos:
            self.on_events(frames.receive_data(view[whole:pos]))
        del view
        self._start, self._end = (0, 0) if pos == end else (pos, end)

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self.resume_writing()

    # Writing.
    def write(self, data: bytes | memoryview) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def buffered(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    async def drain(self) -> None:
        """Waits while the socket's buffer is over its high-water mark."""
        if self.closed.done():
            raise ConnectionResetError("the client's connection is closed")
        if self._writable is not None:
            await self._writable
            if self.closed.done():
                raise ConnectionResetError("the client's connection is closed")
