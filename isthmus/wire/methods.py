"""A gRPC method as both client-port transports serve it (`servicer.grpc_handlers`,
`h2server.H2Server`)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeAlias

if TYPE_CHECKING:
    from grpc import StatusCode

    from isthmus.frontend.message import Message

# The largest request message taken by default (`isthmus up --max-message-bytes`): protobuf
# encodes none of 2 GiB or more, and the stock client cuts host data into 1 MiB messages.
MAX_MESSAGE = 1 << 31


class Pieces(tuple):
    """A serialized message as consecutive buffers (a field's header, then the bytes of a
    host buffer): h2 sends them as they are, grpc.aio joins them."""


class Refused(Exception):
    """An upload sink's refusal: the call ends with this gRPC status code and message."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Batch(tuple):
    """Several messages of a stream, ready at once: h2 frames them together (one DATA frame
    for all), grpc.aio sends them one by one."""


# What a handler (`Method.fn`) or a sink's `end()` hands the transport to send: a response (a
# message, its bytes, `Pieces`, a `Batch`; None: none), a coroutine or future of one, or an
# async iterator of them (a streaming call). The transport tells these apart as it sends
# them (`h2connection.answer`), and a response's kind is the method's: so it stays untyped.
Answer: TypeAlias = Any


class CallContext(Protocol):
    """What a handler sees of its call, on either transport: grpc.aio's ServicerContext, or
    `h2calls.Context` (which also carries the connection's identity, read with getattr)."""

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...

    def peer(self) -> str: ...

    async def abort(self, code: StatusCode, details: str = "") -> NoReturn: ...


class Sink(Protocol):
    """A synchronous handler of one call that h2 feeds message by message (`Method.sink`
    says what each member promises, and what `responses()` and `size` do where a sink has
    them)."""

    def message(self, message: memoryview | Pieces) -> Awaitable[None] | None:
        """Takes one message; an awaitable: no more (nor window) until it is done."""
        ...

    def end(self) -> Answer:
        """The client is done: the serialized response, or what `fn` would return."""
        ...

    def cancel(self, reason: BaseException | None) -> None:
        """The call broke off (the client reset it, or its connection closed)."""
        ...


def joined(serialize: Callable[[Message], bytes] | None) -> Callable[[Answer], bytes] | None:
    """`serialize` for a transport that needs one bytes object per message."""
    def join(message: Answer) -> bytes:
        if isinstance(message, Pieces):
            return b"".join(message)
        return serialize(message) if serialize is not None else message
    return join


def flattened(handler: Callable[..., Answer]
              ) -> Callable[[object, CallContext], AsyncIterator[Answer]]:
    """A streaming handler whose `Batch`es are yielded one message at a time."""
    async def flat(request: object, context: CallContext) -> AsyncIterator[Answer]:
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
    # (request, context) -> its `Answer`; a stream's requests come as an async iterator.
    fn: Callable[..., Answer]
    deserialize: Callable[[bytes], Message] | None = None
    serialize: Callable[[Message], bytes] | None = None
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
    sink: Callable[[CallContext], Sink] | None = None
