"""One gRPC call of the h2 client port (`h2server`): its received messages, its context,
and the mapping of metadata and status messages to and from HTTP/2 headers."""

from __future__ import annotations

import asyncio
import base64
import collections
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeAlias

import grpc

from isthmus.wire.methods import Method, Pieces, Sink

if TYPE_CHECKING:
    from isthmus.frontend.lease_service import Identity
    from isthmus.frontend.message import Message

STREAM_WINDOW = 1 << 16  # bytes a client may send ahead on a stream that is not read
RESERVED = {b"content-type", b"te", b"user-agent", b"grpc-timeout", b"grpc-encoding",
            b"grpc-accept-encoding", b"accept-encoding"}
# A call's metadata as handlers read it: (name, value), a "-bin" name's value decoded bytes.
Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Context:
    """What a handler sees of its call (the part of grpc.aio's ServicerContext used)."""

    def __init__(self, metadata: Metadata, peer: str,
                 identity: Identity | None = None, prove: Callable[[], None] | None = None,
                 local: bool = True) -> None:
        self._metadata, self._peer = metadata, peer
        # Who the connection is, on a shared service (`frontend.lease_service.Identity`; None: a
        # connection without credentials).
        self.identity = identity
        # A shared service's connection without identity: `prove()` says a fleet worker's
        # pulse was recognized on it (`wire/peers.py`: it is then no stranger); None else.
        self.prove = prove
        self.local = local  # from the service's own machine (or a connection with identity)

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Abort(code, details)


class Owner(Protocol):
    """What a call uses of its connection (`h2connection.Connection`)."""

    max_message: int  # bytes of one gRPC message; larger ones are refused

    def acknowledge(self, stream_id: int, size: int) -> None:
        """Hands `size` bytes of flow-control window back to the client."""


class Call:
    """One call: the messages received so far, and whether the client is done sending."""

    def __init__(self, owner: Owner, stream_id: int, method: Method) -> None:
        self.owner, self.id, self.method = owner, stream_id, method
        self.prefix = bytearray()  # of the message being received
        self.need: int | None = None  # its size, once its prefix is in
        self.pieces: list[memoryview] = []  # its bytes so far
        self.have = 0  # ... and how many they are
        self.items: collections.deque[memoryview | Pieces] = collections.deque()
        self.ended = False
        self.unacked = 0  # flow-controlled bytes not yet handed back
        self.waiter: asyncio.Future[None] | None = None
        self.headers_sent = False
        self.task: asyncio.Task[None] | None = None
        self.window = STREAM_WINDOW  # the stream's receive window
        self.bare = False  # opened below h2, which never saw it (`h2connection._open_bare`)
        # A direct stream's (`h2direct`): its sink, its bytes not yet handed back to the
        # client, and what the sink waits for before it takes more.
        self.sink: Sink | None = None
        self.direct_unacked = 0
        self.blocked: asyncio.Future[None] | None = None

    def feed(self, data: bytes | memoryview, flow: int) -> None:
        """Takes a DATA frame's bytes; whole messages become items (views of the frames'
        bytes: a message in one frame is never copied, one across frames once)."""
        self.unacked += flow
        view = memoryview(data)
        while len(view):
            if self.need is None:  # reading a 5-byte prefix
                take = min(5 - len(self.prefix), len(view))
                self.prefix += view[:take]
                view = view[take:]
                if len(self.prefix) < 5:
                    break
                if self.prefix[0]:
                    raise Abort(grpc.StatusCode.UNIMPLEMENTED,
                                 "compressed gRPC messages are not supported; send identity")
                need = int.from_bytes(self.prefix[1:5], "big")
                if need > self.owner.max_message:
                    raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"a gRPC message of {need} bytes is over this server's cap "
                                f"of {self.owner.max_message} bytes; send smaller messages, "
                                "or start the server with a larger --max-message-bytes")
                self.need = need
                self.prefix = bytearray()
            take = min(self.need - self.have, len(view))
            self.pieces.append(view[:take])
            self.have += take
            view = view[take:]
            if self.have == self.need:
                pieces, self.pieces, self.need, self.have = self.pieces, [], None, 0
                # A message across frames stays in pieces for a handler that copies them
                # to where they go (uploads); the others get it joined.
                self.items.append(pieces[0] if len(pieces) == 1 else Pieces(pieces)
                                  if self.method.pieces else memoryview(b"".join(pieces)))
        if not self.items and self.unacked:
            # Only part of a message is here: the client gets room for the rest at once
            # (a message larger than the window would otherwise never complete).
            self.owner.acknowledge(self.id, self.unacked)
            self.unacked = 0
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def cut_short(self) -> Abort | None:
        """Once the client has ended the call: what to answer when it ended inside a
        message (None when it did not)."""
        if self.need is None and not self.prefix:
            return None
        said = f"{self.need} bytes" if self.need is not None else "a 5-byte prefix"
        return Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"the call ended inside a gRPC message ({said} announced, "
                     f"{self.have if self.need is not None else len(self.prefix)} sent); send "
                     "whole messages")

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> memoryview | Pieces | None:
        """The next message (None once the client has sent its last)."""
        while not self.items:
            if self.ended:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if self.unacked:
            self.owner.acknowledge(self.id, self.unacked)
            self.unacked = 0
        return self.items.popleft()

    async def messages(self) -> AsyncIterator[Message | memoryview | Pieces]:
        decode = self.method.deserialize
        while (item := await self.next()) is not None:
            yield decode(whole(item)) if decode is not None else item


def whole(message: memoryview | Pieces) -> bytes:
    return b"".join(message) if isinstance(message, Pieces) else bytes(message)


def metadata(headers: list[tuple[bytes, bytes]]) -> Metadata:
    out: list[tuple[str, bytes | str]] = []
    for key, value in headers:
        if key.startswith(b":") or key in RESERVED:
            continue
        name = key.decode("ascii", errors="replace")
        if name.endswith("-bin"):
            out.append((name, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            out.append((name, value.decode("latin-1")))
    return tuple(out)


def percent_encode(message: str) -> bytes:
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
                    for b in message.encode())
