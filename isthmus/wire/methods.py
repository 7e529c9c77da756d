"""A gRPC method as both client-port transports serve it (`servicer.grpc_handlers`,
`h2server.H2Server`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# The largest request message taken by default (`isthmus up --max-message-bytes`): protobuf
# encodes none of 2 GiB or more, and the stock client cuts host data into 1 MiB messages.
MAX_MESSAGE = 1 << 31


class Pieces(tuple):
    """A serialized message as consecutive buffers (a field's header, then the bytes of a
    host buffer): h2 sends them as they are, grpc.aio joins them."""


class Refused(Exception):
    """An upload sink's refusal: the call ends with this gRPC status code and message."""

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Batch(tuple):
    """Several messages of a stream, ready at once: h2 frames them together (one DATA frame
    for all), grpc.aio sends them one by one."""


def joined(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """`serialize` for a transport that needs one bytes object per message."""
    def join(message: Any) -> bytes:
        if isinstance(message, Pieces):
            return b"".join(message)
        return serialize(message) if serialize is not None else message
    return join


def flattened(handler: Callable[..., Any]) -> Callable[..., Any]:
    """A streaming handler whose `Batch`es are yielded one message at a time."""
    async def flat(request: Any, context: Any) -> Any:
        async for item in handler(request, context):
            if isinstance(item, Batch):
                for message in item:
                    yield message
            else:
                yield item
    return flat


@dataclasses.dataclass(frozen=True, slots=True)
class Method:
    """One gRPC method: its shape, handler and (de)serializers (None: raw bytes)."""

    kind: str  # "unary_unary", "unary_stream", "stream_unary" or "stream_stream"
    fn: Callable[..., Any]
    deserialize: Callable[[bytes], Any] | None = None
    serialize: Callable[[Any], bytes] | None = None
    # Raw requests only: the handler takes a message that came in several frames as
    # `Pieces` instead of joined (grpc.aio always gives bytes).
    pieces: bool = False
    # A synchronous handler of the same call, for transports that can hand it each
    # message as it arrives (h2): `sink(context)` returns an object with `message(m)`,
    # `end()` and `cancel(reason)`; `Refused` from any of them ends the call with its
    # status. `end()` returns the serialized response (sent at once: no task, no await),
    # or what `fn` would return (a coroutine or async iterator) when the answer must wait.
    # `message` may return an awaitable: no more messages (nor window) until it is done.
    # A sink with `responses()` (an async iterator) streams its answer from the start, and
    # its `end()` returns None. An upload's sink may say its `size` in bytes: one that fits
    # the stream's first window is not given a larger one (a WINDOW_UPDATE less each way).
    sink: Callable[[Any], Any] | None = None
