"""Direct streams of the h2 client port: calls whose DATA frames never reach h2.

A method with a sink (`Method.sink`) is served here once h2 has opened its stream. The
frames `h2frames.Wire` parses go to the sink as whole messages, in the turn they arrive: no
task, no future, no pass through h2's stream state machine per frame. Flow control is ours:
the client's window is handed back in raw WINDOW_UPDATE frames (the connection's in large
steps, at once; the stream's once the sink has taken the bytes), and a sink that must not
take more for now (a session whose workers are far behind) returns an awaitable, until
which the stream's messages wait here and its window stays closed. h2 never counted these
bytes, so its own accounting stays a bound of the client's: should the stream fall back to
h2 (after a refusal), h2 sees no more than it allowed.

At the end of the stream the sink's answer goes out: a serialized response is written at
once as fixed frames (`Frames.respond_closed`), anything else (an async iterator, a
coroutine) by a task; a sink with a streaming answer (the session: its `responses()`) has
it running from the start.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import grpc
import h2.exceptions

from isthmus.wire.h2calls import Abort, Call, Context
from isthmus.wire.h2frames import END_STREAM, Frames, Wire, violation, window_update
from isthmus.wire.methods import Answer, Method, Pieces, Refused, Sink

logger = logging.getLogger(__name__)

CONNECTION_ACK = 16 << 20  # direct bytes handed back to the connection at a time


class Owner(Protocol):
    """What the direct streams use of their connection (`h2connection.Connection`)."""

    h2: Frames
    wire: Wire
    streams: dict[int, Call]

    def schedule_flush(self) -> None: ...

    def trailers(self, stream: Call, code: grpc.StatusCode, message: str) -> None: ...

    def stop_sending(self, stream: Call) -> None: ...

    async def answer(self, stream: Call, answer: Answer) -> None: ...

    async def answer_bare(self, stream: Call, framed: bytes) -> None: ...


class Direct:
    """The direct streams of one connection (`owner`: its `h2connection.Connection`)."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self._unacked = 0  # direct bytes not yet handed back to the connection

    def start(self, stream: Call, method: Method, context: Context) -> None:
        assert method.sink is not None
        try:
            stream.sink = method.sink(context)
            responses = getattr(stream.sink, "responses", None)
            if responses is not None:  # a streaming answer runs from the start
                stream.task = asyncio.get_running_loop().create_task(
                    self.owner.answer(stream, responses()))
        except Exception as e:  # noqa: BLE001 - Refused, or a bug: this call fails alone
            self._fail(stream, e)
            return
        self.owner.wire.direct[stream.id] = (
            lambda flags, body, flow: self.data(stream, flags, body, flow))

    def data(self, stream: Call, flags: int, body: memoryview | bytes, flow: int) -> None:
        """A DATA frame of a direct stream."""
        stream.direct_unacked += flow
        # Invariant: the client may send the stream's window less its bytes not yet handed
        # back (each WINDOW_UPDATE hands back all of them); more is its error, as in h2.
        if stream.direct_unacked > stream.window:
            raise violation(self.owner.h2, h2.exceptions.FlowControlError,
                            f"{stream.direct_unacked} bytes sent on stream {stream.id}, "
                            f"whose window is {stream.window}")
        self._count(flow)
        try:
            if body:
                stream.feed(body, 0)
            if flags & END_STREAM:
                stream.ended = True
                cut = stream.cut_short()
                if cut is not None:
                    raise cut
            self._consume(stream)
        except Exception as e:  # noqa: BLE001 - Refused, Abort (compressed), or a bug
            self._fail(stream, e)

    def _count(self, flow: int) -> None:
        """Direct bytes taken: the connection's window is handed back in large steps."""
        self._unacked += flow
        if self._unacked >= CONNECTION_ACK:
            self.owner.h2.raw(window_update(0, self._unacked))
            self._unacked = 0

    def drain(self, stream: Call) -> None:
        """What the client still sends on a bare stream answered before it ended (a
        refusal) is dropped here, counted for the connection's window: h2, which never
        knew the stream, would reset it as a closed one (STREAM_CLOSED), and the client
        could take that reset for the call's outcome."""
        def data(flags: int, body: memoryview | bytes, flow: int) -> None:
            self._count(flow)
            if flags & END_STREAM:
                self.owner.wire.direct.pop(stream.id, None)

        self.owner.wire.direct[stream.id] = data

    def _consume(self, stream: Call) -> None:
        """Messages to the sink while it takes them; then the window, or the end."""
        # Invariant: a direct stream has its sink until it ends or fails.
        sink: Sink = stream.sink  # type: ignore[assignment]
        items = stream.items
        while items and stream.blocked is None:
            wait = sink.message(items.popleft())
            if wait is not None:
                blocked = asyncio.ensure_future(wait)
                stream.blocked = blocked
                blocked.add_done_callback(lambda _: self._unblock(stream))
        if stream.blocked is not None:
            return
        if stream.ended and not items:
            self._end(stream)
        elif stream.direct_unacked >= stream.window // 4:
            self.owner.h2.raw(window_update(stream.id, stream.direct_unacked))
            stream.direct_unacked = 0
            self.owner.schedule_flush()

    def _unblock(self, stream: Call) -> None:
        stream.blocked = None
        if stream.sink is None:
            return
        try:
            self._consume(stream)
        except Exception as e:  # noqa: BLE001
            self._fail(stream, e)
        self.owner.schedule_flush()

    def _end(self, stream: Call) -> None:
        response = stream.sink.end()  # type: ignore[union-attr]  # (the invariant above)
        self.owner.wire.direct.pop(stream.id, None)
        stream.sink = None
        if isinstance(response, asyncio.Future):  # the answer, once it is known
            response.add_done_callback(lambda _: self._answered(stream, response))
            return
        self._answer(stream, response)

    def _answered(self, stream: Call, answer: asyncio.Future[Answer]) -> None:
        if stream.id not in self.owner.streams:
            return  # the client reset the call meanwhile
        try:
            self._answer(stream, answer.result())
        except Exception as e:  # noqa: BLE001 - Refused, or a bug: this call fails alone
            self._fail(stream, e)
        self.owner.schedule_flush()

    def _answer(self, stream: Call, response: Answer) -> None:
        owner = self.owner
        if response is None and stream.task is not None:  # the streaming answer ends it
            owner.h2.receive_data_frame(stream.id, END_STREAM, b"")
            return
        if isinstance(response, bytes):
            framed = b"\0" + len(response).to_bytes(4, "big") + response
            if owner.h2.respond_closed(stream.id, framed, stream.bare):
                owner.streams.pop(stream.id, None)
                owner.schedule_flush()
                return
            if stream.bare:  # h2 cannot send on it: the answer waits for room here
                stream.task = asyncio.get_running_loop().create_task(
                    owner.answer_bare(stream, framed))
                return
            response = Pieces((response,))  # no window for it yet: it waits for room
        elif stream.bare:
            raise TypeError(f"a bare stream's sink answered {type(response).__name__}, "
                            "not bytes")
        # The answer comes later: h2 closes its side of the stream as if the last frame had
        # come through it, and a task sends the answer.
        owner.h2.receive_data_frame(stream.id, END_STREAM, b"")
        stream.task = asyncio.get_running_loop().create_task(owner.answer(stream, response))

    def _fail(self, stream: Call, error: Exception) -> None:
        """The sink refused (or failed): the call ends with that status; what the client
        still sends on the stream goes to h2, which counts it (on a bare stream: is
        drained, after a RST_STREAM NO_ERROR that asks the client to stop)."""
        sink = stream.sink
        if isinstance(error, (Refused, Abort)):
            code, message = error.code, error.message
        else:
            logger.exception("%s failed", type(sink).__name__)
            code, message = grpc.StatusCode.INTERNAL, "the server failed unexpectedly; see its log"
        self.owner.wire.direct.pop(stream.id, None)
        stream.sink = None
        if sink is not None:
            sink.cancel(error)
        if stream.task is not None:
            stream.task.cancel()
        self.owner.trailers(stream, code, message)
        if stream.ended and not stream.bare:
            self.owner.h2.receive_data_frame(stream.id, END_STREAM, b"")
        elif isinstance(error, Abort) or stream.bare:  # refused: no more of it
            self.owner.stop_sending(stream)

    def cancel(self, stream: Call, reason: BaseException) -> None:
        """The client reset the stream, or its connection closed."""
        self.owner.wire.direct.pop(stream.id, None)
        sink, stream.sink = stream.sink, None
        if sink is not None:
            sink.cancel(reason)
