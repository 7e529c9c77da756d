"""The fleet's control stream: length-prefixed frames over a plain TCP connection.

A worker's commands, replies and data travel on one stream to the controller, each frame an
8-byte little-endian length and an encoded message (`messages.encode`). It carries what a
gRPC stream carried before, for a tenth of the CPU per message (measured: about 6 µs a side
for a small frame, against 60-75 µs through grpc.aio), which is what a program over several
hosts costs: one frame to each of them. gRPC stays for the unary calls (where the stream
is, and the worker's pulse).

Bulk bytes (a put's or a fetch's, `codec.Bulk`) travel beside the message: such a frame has
the length's top bit set, and its payload is the encoded rest behind its own 8-byte length,
then those bytes as they are. The sender writes them from its own buffer; the receiver
(`FrameStream`, an asyncio buffered protocol) reads a large tail from the socket straight
into an aligned buffer of its own, which jaxlib can adopt as device memory. Neither end's
Python copies them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any

from isthmus.hostmem import aligned_empty

_LENGTH = struct.Struct("<Q")
_TAILED = 1 << 63  # in a frame's length: the payload is a message with bulk bytes after it
READ_LIMIT = 16 << 20  # bytes of whole frames queued unread before the socket is paused
READ_BUFFER = 1 << 18  # what one read of the socket may take, besides a large tail
LARGE_TAIL = 1 << 20  # bulk tails from this size are read in place
SMALL_FRAME = 64 << 10  # frames below this go out in one write with their length


class StreamClosed(ConnectionError):
    """The other end closed the stream (or it broke)."""


class Parts(tuple):
    """A payload in pieces (`messages.encode`): the encoded message behind its 8-byte
    length, then bulk bytes, written as they are."""


class Tailed:
    """A received payload of `Parts`: the encoded message, and the bulk bytes after it."""

    __slots__ = ("packed", "tail")

    def __init__(self, packed: bytes | memoryview, tail: memoryview) -> None:
        self.packed, self.tail = packed, tail


class FrameStream(asyncio.BufferedProtocol):
    """Both ends of a control stream's socket: `read_frame` and `readexactly` (for the
    handshake, before the first frame) on the way in, `write` on the way out."""

    def __init__(self, on_connected: Callable[[FrameStream], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self._on_connected = on_connected
        self._buf = bytearray(READ_BUFFER)
        self._start = self._end = 0  # the bytes of _buf not taken yet
        self._framing = False  # from the first read_frame on, frames are parsed as they come
        self._frames: collections.deque[bytes | Tailed] = collections.deque()
        self._queued = 0  # bytes of those frames
        self._tail: tuple[bytes, memoryview] | None = None  # a large tail read in place
        self._filled = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None  # set when the stream ended
        self._paused = False
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # ---- the protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._tail is not None:
            return self._tail[1][self._filled:]
        self._buf, self._start, self._end = read_room(self._buf, self._start, self._end)
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._tail is not None:
            self._filled += nbytes
            packed, tail = self._tail
            if self._filled == len(tail):
                self._tail = None
                self._queue(Tailed(packed, tail))
        else:
            self._end += nbytes
            if self._framing:
                try:
                    self._split()
                except StreamClosed as e:  # not our framing: the stream is over
                    self._error = e
                    self.close()
        self._wake()

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._error = StreamClosed(str(exc) if exc else "the other end closed the stream")
        if not self._closed.done():
            self._closed.set_result(None)
        self._wake()

    # ---- reading -------------------------------------------------------------------------

    async def readexactly(self, n: int) -> bytes:
        """The next `n` bytes, before any frame (the handshake's)."""
        while self._end - self._start < n:
            await self._wait()
        data = bytes(self._buf[self._start:self._start + n])
        self._start += n
        return data

    async def read_frame(self) -> bytes | Tailed:
        """The next frame's payload; raises StreamClosed at the end of the stream."""
        if not self._framing:
            self._framing = True
            self._split()
        while not self._frames:
            await self._wait()
        frame = self._frames.popleft()
        self._queued -= _size(frame)
        if self._paused and self._queued < READ_LIMIT // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return frame

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _queue(self, frame: bytes | Tailed) -> None:
        self._frames.append(frame)
        self._queued += _size(frame)
        if not self._paused and self._queued > READ_LIMIT and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _split(self) -> None:
        """Takes the whole frames out of the buffer; a large tail still to come is then
        read into a buffer of its own (`get_buffer`)."""
        buf, pos, end = self._buf, self._start, self._end
        while end - pos >= _LENGTH.size:
            length = _LENGTH.unpack_from(buf, pos)[0]
            size = length & ~_TAILED
            body = pos + _LENGTH.size
            if not length & _TAILED or size < LARGE_TAIL:
                if end - body < size:
                    break
                payload = bytes(buf[body:body + size])
                self._queue(_tailed(payload) if length & _TAILED else payload)
                pos = body + size
                continue
            if end - body < _LENGTH.size:
                break
            packed_end = body + _LENGTH.size + _LENGTH.unpack_from(buf, body)[0]
            if packed_end > body + size:
                raise StreamClosed("a frame's message is longer than the frame")
            if end < packed_end:
                break
            packed = bytes(buf[body + _LENGTH.size:packed_end])
            tail = memoryview(aligned_empty(body + size - packed_end))
            have = min(len(tail), end - packed_end)
            tail[:have] = buf[packed_end:packed_end + have]
            pos = packed_end + have
            if have < len(tail):  # the rest comes from the socket straight into it
                self._tail, self._filled = (packed, tail), have
                break
            self._queue(Tailed(packed, tail))
        self._start, self._end = (0, 0) if pos == end else (pos, end)

    # ---- writing (what StreamWriter offered) ---------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> Any:
        return default if self.transport is None else self.transport.get_extra_info(
            name, default)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self) -> None:
        await self._closed

    async def start_tls(self, context: ssl.SSLContext) -> None:
        """The server's side of TLS on this stream, before any byte was read."""
        assert self.transport is not None
        transport = await asyncio.get_running_loop().start_tls(
            self.transport, self, context, server_side=True)
        self.transport = transport


def read_room(buf: bytearray, start: int, end: int, size: int = READ_BUFFER
              ) -> tuple[bytearray, int, int]:
    """A socket read buffer with room after its unread bytes `buf[start:end]`: `buf`
    itself, or a new one that holds them (never a resize: the transport may still hold a
    view of the old one). Returns the buffer and where its unread bytes are."""
    if len(buf) - end >= min(4096, len(buf) // 4):  # a small first buffer fills first
        return buf, start, end
    pending = end - start
    fresh = bytearray(max(size, 2 * pending))
    fresh[:pending] = memoryview(buf)[start:end]
    return fresh, 0, pending


def _size(frame: bytes | Tailed) -> int:
    return len(frame.tail) if isinstance(frame, Tailed) else len(frame)


def _tailed(payload: bytes) -> Tailed:
    view = memoryview(payload)
    if len(view) < _LENGTH.size:
        raise StreamClosed("a frame with bulk bytes is too short")
    end = _LENGTH.size + _LENGTH.unpack_from(view)[0]
    if end > len(view):
        raise StreamClosed("a frame's message is longer than the frame")
    return Tailed(view[_LENGTH.size:end], view[end:])


async def connect(host: str, port: int, context: ssl.SSLContext | None = None,
                  server_hostname: str | None = None) -> FrameStream:
    """A control stream to `host`:`port`, in TLS under `context` (checking the
    certificate's name against `server_hostname`) unless that is None."""
    _, stream = await asyncio.get_running_loop().create_connection(
        FrameStream, host, port, ssl=context, server_hostname=server_hostname)
    return stream


async def connect_unix(path: str) -> FrameStream:
    """A control stream over the Unix socket at `path` (a fleet on one machine)."""
    _, stream = await asyncio.get_running_loop().create_unix_connection(FrameStream, path)
    return stream


async def serve_unix(on_connected: Callable[[FrameStream], None], path: str
                     ) -> asyncio.Server:
    """Listens for control streams on a Unix socket (mode 0600: this user's workers)."""
    old = os.umask(0o177)
    try:
        return await asyncio.get_running_loop().create_unix_server(
            lambda: FrameStream(on_connected), path)
    finally:
        os.umask(old)


async def serve(on_connected: Callable[[FrameStream], None], host: str, port: int
                ) -> asyncio.Server:
    """Listens for control streams; `on_connected` runs in each one's connection_made."""
    return await asyncio.get_running_loop().create_server(
        lambda: FrameStream(on_connected), host, port)


async def read_frame(stream: FrameStream) -> bytes | Tailed:
    """The next frame's payload; raises StreamClosed at the end of the stream."""
    return await stream.read_frame()


def write_frame(writer: FrameStream, payload: bytes | Parts) -> None:
    """Queues one frame on `writer` (dropped once the stream is closing)."""
    if writer.is_closing():
        return
    if isinstance(payload, Parts):
        length = sum(len(part) for part in payload)
        if length < SMALL_FRAME:  # one send for the frame, not one per part
            writer.write(b"".join((_LENGTH.pack(length | _TAILED), *payload)))
            return
        writer.write(_LENGTH.pack(length | _TAILED) + payload[0])
        for part in payload[1:]:
            writer.write(part)
    elif len(payload) < SMALL_FRAME:  # one send: copying a small frame costs less
        writer.write(_LENGTH.pack(len(payload)) + payload)
    else:
        writer.write(_LENGTH.pack(len(payload)))
        writer.write(payload)


def write_frames(writer: FrameStream, payloads: list[bytes | Parts]) -> None:
    """Queues several frames on `writer`: runs of small plain ones in one write."""
    if writer.is_closing():
        return
    small: list[bytes] = []
    for payload in payloads:
        if type(payload) is bytes and len(payload) < SMALL_FRAME:
            small += (_LENGTH.pack(len(payload)), payload)
            continue
        if small:
            writer.write(b"".join(small))
            small = []
        write_frame(writer, payload)
    if small:
        writer.write(b"".join(small))


def keep_alive(writer: FrameStream | asyncio.BaseTransport, idle: int = 10,
               interval: int = 5,
               count: int = 3) -> None:
    """TCP keepalive on the stream's socket, so that an end whose machine vanished (no FIN
    ever comes) is noticed within about idle + interval * count seconds."""
    sock: socket.socket | None = writer.get_extra_info("socket")
    if sock is None or sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
