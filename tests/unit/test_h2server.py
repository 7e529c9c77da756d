"""The h2 client-port transport (wire/h2server.py, h2connection.py) against grpcio's own
client, over a real socket on 127.0.0.1: every method shape, messages larger than the
flow-control windows both ways, binary metadata, statuses with their messages, unknown
methods, a stream that is not read holding its client back without stalling the streams
beside it, and a cancelled call cancelling its handler. The same for direct streams
(`Method.sink`, wire/h2direct.py): uploads, unary calls answered at once or later, a
streaming sink that holds its client back, refusals, and h2's state left sound after
thousands of them."""

import asyncio
import contextlib

import grpc
import grpc.aio
import pytest

from isthmus.wire.h2server import H2Server
from isthmus.wire.methods import Batch, Method, Pieces, Refused


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def _until(condition, what, timeout=5.0):
    """Yields to the loop until `condition()` holds; fails naming `what` after `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Handlers:
    def __init__(self):
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.read = 0
        self.hanging = asyncio.Event()
        self.sink_messages = 0
        self.sinks_cancelled = 0

    async def echo(self, request, context):
        metadata = dict(context.invocation_metadata())
        return request + metadata.get("x-tag-bin", b"") + metadata.get("x-name", "").encode()

    async def fail(self, request, context):
        await context.abort(grpc.StatusCode.DATA_LOSS, "worker 3 lost: données perdues 100%")

    async def crash(self, request, context):
        raise RuntimeError("a bug")

    async def download(self, request, context):
        size = int(request)
        for i in range(3):
            yield bytes([i]) * size

    async def burst(self, request, context):
        yield Batch((b"a", b"bc"))  # framed together
        yield Batch((b"x" * 70_000, b"d"))  # over the size framed together
        yield b"e"

    async def upload(self, chunks, context):
        total = 0
        async for chunk in chunks:  # a message across frames comes in Pieces
            total += sum(map(len, chunk)) if isinstance(chunk, Pieces) else len(chunk)
        return str(total).encode()

    async def chat(self, requests, context):
        async for request in requests:
            self.read += 1
            if request == b"wait":
                await self.release.wait()
            yield bytes(request)[::-1]

    async def hang(self, request, context):
        self.hanging.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield b""


class Sink:
    """A direct upload handler (`Method.sink`): counts what it is given, refuses on request."""

    def __init__(self, handlers, context):
        if dict(context.invocation_metadata()).get("x-refuse") == "open":
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused at once")
        self.handlers, self.total, self.messages = handlers, 0, 0

    def message(self, chunk):
        if bytes(chunk[0] if isinstance(chunk, Pieces) else chunk)[:6] == b"refuse":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "refused midway")
        self.total += sum(map(len, chunk)) if isinstance(chunk, Pieces) else len(chunk)
        self.messages += 1
        self.handlers.sink_messages += 1

    def end(self):
        return f"{self.messages}:{self.total}".encode()

    def cancel(self, reason):
        self.handlers.sinks_cancelled += 1


class Quick:
    """A unary sink: answers at once, later (an async iterator), or refuses."""

    def __init__(self, handlers, context):
        self.handlers, self.request = handlers, None

    def message(self, request):
        self.request = bytes(request)

    def end(self):
        if self.request == b"refuse":
            raise Refused(grpc.StatusCode.NOT_FOUND, "no such thing")
        if self.request.startswith(b"later:"):
            return self.handlers.download(self.request[6:], None)
        return self.request.upper()

    def cancel(self, reason):
        pass


class Chatter:
    """A streaming sink (a session's shape): echoes each message reversed; b"wait" holds
    the stream (its messages and window) until `release` is set."""

    def __init__(self, handlers, context):
        self.handlers, self.queue = handlers, asyncio.Queue()

    def message(self, message):
        self.handlers.read += 1
        self.queue.put_nowait(bytes(message)[::-1])
        if bytes(message) == b"wait":
            return self.handlers.release.wait()
        return None

    async def responses(self):
        while (item := await self.queue.get()) is not None:
            yield item

    def end(self):
        self.queue.put_nowait(None)

    def cancel(self, reason):
        self.handlers.sinks_cancelled += 1
        self.queue.put_nowait(None)


@contextlib.asynccontextmanager
async def _serving(handlers):
    server = H2Server({
        "/t.T/Echo": Method("unary_unary", handlers.echo),
        "/t.T/Fail": Method("unary_unary", handlers.fail),
        "/t.T/Crash": Method("unary_unary", handlers.crash),
        "/t.T/Download": Method("unary_stream", handlers.download),
        "/t.T/Upload": Method("stream_unary", handlers.upload, pieces=True),
        "/t.T/Burst": Method("unary_stream", handlers.burst),
        "/t.T/Chat": Method("stream_stream", handlers.chat),
        "/t.T/Hang": Method("unary_stream", handlers.hang),
        "/t.T/Quick": Method("unary_stream", handlers.download,
                             sink=lambda context: Quick(handlers, context)),
        "/t.T/DirectChat": Method("stream_stream", handlers.chat,
                                  sink=lambda context: Chatter(handlers, context)),
        "/t.T/Sink": Method("stream_unary", handlers.upload, pieces=True,
                            sink=lambda context: Sink(handlers, context)),
    })
    port = handlers.port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=(
        ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)))
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop()


def _served(test):
    """`test(handlers, channel)` as a plain test, against a fresh server and client."""
    def served():
        async def body():
            handlers = Handlers()
            async with _serving(handlers) as channel:
                await test(handlers, channel)
        run(body())
    served.__name__ = test.__name__
    return served


@_served
async def test_every_method_shape_and_large_messages_both_ways(handlers, channel):
    echo = channel.unary_unary("/t.T/Echo")
    assert await echo(b"abc", metadata=(("x-tag-bin", b"\x00\xff"),
                                        ("x-name", "n"))) == b"abc\x00\xffn"
    big = 9 << 20  # over every window: the stream's, the connection's initial one
    got = [m async for m in channel.unary_stream("/t.T/Download")(str(big).encode())]
    assert [len(m) for m in got] == [big] * 3
    assert [m[0] for m in got] == [0, 1, 2] and got[2][-1] == 2
    got = [m async for m in channel.unary_stream("/t.T/Burst")(b"")]
    assert got == [b"a", b"bc", b"x" * 70_000, b"d", b"e"]

    async def chunks():
        for _ in range(5):
            yield b"x" * (3 << 20)

    assert await channel.stream_unary("/t.T/Upload")(chunks()) == str(15 << 20).encode()
    call = channel.stream_stream("/t.T/Chat")()
    for word in (b"one", b"two", b"three"):
        await call.write(word)
        assert await call.read() == word[::-1]
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


@_served
async def test_statuses_messages_and_unknown_methods(handlers, channel):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary("/t.T/Fail")(b"")
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert info.value.details() == "worker 3 lost: données perdues 100%"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary("/t.T/Crash")(b"")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "see its log" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary("/t.T/Nope")(b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The connection serves on after every one of those.
    assert await channel.unary_unary("/t.T/Echo")(b"ok") == b"ok"


@_served
async def test_a_stream_not_read_holds_its_client_back_not_its_neighbours(handlers, channel):
    call = channel.stream_stream("/t.T/Chat")()
    await call.write(b"wait")
    await _until(lambda: handlers.read >= 1, "the handler to read the first message")

    async def writes():
        for _ in range(400):  # 400 KiB: far over the stream's 64 KiB window
            await call.write(b"y" * 1024)

    writer = asyncio.ensure_future(writes())
    await asyncio.sleep(0.5)
    assert not writer.done()  # held back by flow control
    assert handlers.read == 1

    async def chunks():
        yield b"z" * (4 << 20)

    # Another stream on the same connection moves meanwhile.
    assert await channel.stream_unary("/t.T/Upload")(chunks()) == str(4 << 20).encode()
    handlers.release.set()
    await asyncio.wait_for(writer, 10)
    await call.done_writing()
    replies = [r async for r in call]
    assert len(replies) == 401 and replies[0] == b"tiaw"


@_served
async def test_a_cancelled_call_cancels_its_handler(handlers, channel):
    call = channel.unary_stream("/t.T/Hang")(b"")
    await asyncio.wait_for(handlers.hanging.wait(), 5)
    call.cancel()
    await asyncio.wait_for(handlers.cancelled.wait(), 5)


@_served
async def test_a_message_larger_than_the_window_arrives_on_a_read_stream(handlers, channel):
    call = channel.stream_stream("/t.T/Chat")()
    for size in (200_000, 3 << 20):  # the session stream's window is 64 KiB
        await call.write(b"q" * size)
        assert len(await call.read()) == size
    await call.done_writing()


@_served
async def test_direct_uploads_bypass_h2_and_leave_the_connection_sound(handlers, channel):
    sink = channel.stream_unary("/t.T/Sink")

    async def chunks(count, size):
        for _ in range(count):
            yield b"s" * size

    # Over the stream's window (raw window updates) and, in all, over the connection's
    # hand-back step; then hundreds at once, and an upload with no message at all.
    for _ in range(3):
        assert await sink(chunks(5, 4 << 20)) == f"5:{20 << 20}".encode()
    many = await asyncio.gather(*(sink(chunks(3, 1000 + i)) for i in range(300)))
    assert many == [f"3:{3 * (1000 + i)}".encode() for i in range(300)]
    assert await sink(chunks(0, 0)) == b"0:0"
    # h2's state stayed whole: other calls, and a download over every window, still work.
    big = 9 << 20
    got = [m async for m in channel.unary_stream("/t.T/Download")(str(big).encode())]
    assert [len(m) for m in got] == [big] * 3
    assert await channel.unary_unary("/t.T/Echo")(b"ok") == b"ok"


@_served
async def test_a_direct_upload_refused_or_cancelled(handlers, channel):
    sink = channel.stream_unary("/t.T/Sink")

    async def chunks(*messages):
        for m in messages:
            yield m

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sink(chunks(b"a" * 100, b"refuse", b"b" * (3 << 20)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "refused midway"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sink(chunks(b"x"), metadata=(("x-refuse", "open"),))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert handlers.sinks_cancelled == 1  # the refusal midway; a refused open made none

    release = asyncio.Event()
    before = handlers.sink_messages
    call = sink(_stalled(release))
    await _until(lambda: handlers.sink_messages > before, "the sink to take the first chunk")
    call.cancel()
    await _until(lambda: handlers.sinks_cancelled == 2, "the sink to hear of the cancel")
    assert await sink(chunks(b"ok")) == b"1:2"


@_served
async def test_unary_sinks_answer_at_once_or_later(handlers, channel):
    quick = channel.unary_stream("/t.T/Quick")
    assert [m async for m in quick(b"abc")] == [b"ABC"]
    # Answered later (the streaming handler's answer), over every window.
    got = [m async for m in quick(b"later:%d" % (9 << 20))]
    assert [len(m) for m in got] == [9 << 20] * 3
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [m async for m in quick(b"refuse")]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no such thing"
    answers = await asyncio.gather(*(_collect(quick(b"x%d" % i)) for i in range(300)))
    assert answers == [[b"X%d" % i] for i in range(300)]


async def _stalled(release):
    """An upload's chunks: one, then nothing until `release` (a call to cancel midway)."""
    yield b"c" * 1000
    await release.wait()
    yield b"never"


async def _collect(call):
    return [m async for m in call]


@_served
async def test_a_direct_stream_that_waits_holds_its_client_back_not_its_neighbours(
        handlers, channel):
    call = channel.stream_stream("/t.T/DirectChat")()
    await call.write(b"wait")
    assert await call.read() == b"tiaw"

    async def writes():
        for _ in range(400):  # 400 KiB: far over the stream's 64 KiB window
            await call.write(b"y" * 1024)

    writer = asyncio.ensure_future(writes())
    await asyncio.sleep(0.5)
    assert not writer.done()  # held back: its window stays closed
    assert handlers.read == 1  # and what did come waits

    async def chunks():
        yield b"z" * (4 << 20)

    # Other streams on the same connection move meanwhile, direct ones too.
    assert await channel.stream_unary("/t.T/Sink")(chunks()) == f"1:{4 << 20}".encode()
    quick = channel.unary_stream("/t.T/Quick")
    assert [m async for m in quick(b"abc")] == [b"ABC"]
    handlers.release.set()
    await asyncio.wait_for(writer, 10)
    await call.done_writing()
    replies = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        replies.append(reply)
    assert len(replies) == 400 and handlers.read == 401
    assert await call.code() == grpc.StatusCode.OK


def test_a_data_frame_on_stream_zero_gets_a_goaway_not_a_traceback(caplog):
    """hyperframe refuses to parse DATA on stream 0 before h2 sees it: the server answers with
    GOAWAY (PROTOCOL_ERROR) and closes, logging one line, and keeps serving others."""
    import logging
    import struct

    async def body():
        handlers = Handlers()
        async with _serving(handlers) as channel:
            reader, writer = await asyncio.open_connection("127.0.0.1", handlers.port)
            writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                         + struct.pack(">I", 0)[1:] + b"\x04\x00"
                         + struct.pack(">I", 0))  # the preface and an empty SETTINGS
            writer.write(struct.pack(">I", 4)[1:] + b"\x00\x00" + struct.pack(">I", 0) + b"oops")
            await writer.drain()
            received = b""
            while chunk := await asyncio.wait_for(reader.read(65536), 10):
                received += chunk
            writer.close()
            frames, goaway = received, None
            while len(frames) >= 9:
                length = int.from_bytes(frames[:3], "big")
                if frames[3] == 7:  # GOAWAY
                    goaway = int.from_bytes(frames[9 + 4:9 + 8], "big")
                frames = frames[9 + length:]
            assert goaway == 1, received  # PROTOCOL_ERROR
            call = channel.unary_unary("/t.T/Echo")
            assert await call(b"still here") == b"still here"

    with caplog.at_level(logging.INFO):
        run(body())
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert any("malformed HTTP/2 frame" in r.getMessage() for r in caplog.records)


@_served
async def test_uploads_opened_below_h2_answer_refuse_and_cancel_as_h2_ones_do(
        handlers, channel):
    """After a connection's first upload its HEADERS frames leave HPACK's table alone, and
    the uploads are opened below h2 (bare streams, `Connection._open_bare`), their
    WINDOW_UPDATE frames too: answers, refusals (at once and midway), a cancel and an
    upload over the stream's window behave exactly as through h2, and h2's own streams
    beside them still work."""
    from isthmus.wire.h2connection import Connection

    opened = []
    original = Connection._open_bare

    def counting(self, stream_id, block):
        took = original(self, stream_id, block)
        opened.append(took)
        return took

    Connection._open_bare = counting
    try:
        sink = channel.stream_unary("/t.T/Sink")

        async def chunks(*messages):
            for m in messages:
                yield m

        assert await sink(chunks(b"a")) == b"1:1"  # the first: its fields enter the table
        assert [await sink(chunks(b"b" * 10, b"c")) for _ in range(3)] == [b"2:11"] * 3
        assert opened.count(True) >= 3, opened
        took = opened.count(True)
        # Over the stream's 64 KiB window: raw window updates on a bare stream.
        assert await sink(chunks(*[b"d" * (1 << 20)] * 5)) == f"5:{5 << 20}".encode()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await sink(chunks(b"a" * 100, b"refuse", b"b" * (3 << 20)))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "refused midway")
        # Refused at open, the client still sending: the second time its header block is
        # all indexed (bare); its answer is the refusal, never a reset of a closed stream.
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sink(chunks(*[b"x" * 50_000] * 4), metadata=(("x-refuse", "open"),))
            outcome = (info.value.code(), info.value.details())
            if outcome == (grpc.StatusCode.INTERNAL, "Internal error from Core"):
                # grpc.aio's own race (seen once in three loaded runs): its send of the
                # next message failed on the stream the refusal closed, and it reported
                # that instead of the trailers. Not a reset from the server, which reads
                # "Received RST_STREAM".
                assert "SendMessageOperation" in info.value.debug_error_string()
                continue
            assert outcome == (grpc.StatusCode.RESOURCE_EXHAUSTED, "refused at once"), (
                info.value.details(), info.value.debug_error_string())
        release = asyncio.Event()
        cancelled = handlers.sinks_cancelled
        before = handlers.sink_messages
        call = sink(_stalled(release))
        await _until(lambda: handlers.sink_messages > before, "the sink's first chunk")
        call.cancel()
        await _until(lambda: handlers.sinks_cancelled > cancelled, "the sink to hear the cancel")
        assert opened.count(True) >= took + 3, opened  # those were bare too
        many = await asyncio.gather(*(sink(chunks(b"e" * i)) for i in range(1, 201)))
        assert many == [f"1:{i}".encode() for i in range(1, 201)]
        # h2's streams beside them: a unary call, a download over every window.
        assert await channel.unary_unary("/t.T/Echo")(b"ok") == b"ok"
        got = [m async for m in channel.unary_stream("/t.T/Download")(b"%d" % (9 << 20))]
        assert [len(m) for m in got] == [9 << 20] * 3
    finally:
        Connection._open_bare = original


def test_a_bare_upload_refused_at_open_drains_what_still_comes():
    """An upload refused at open on a bare stream: the client gets the refusal and a
    RST_STREAM NO_ERROR, and DATA it had already sent is dropped, never answered with a
    reset of a closed stream (STREAM_CLOSED), which a client may take for the outcome."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    async def body():
        handlers = Handlers()
        async with _serving(handlers) as channel:
            port = handlers.port

            def talk():
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                conn.initiate_connection()
                sock.sendall(conn.data_to_send())
                headers = [(":method", "POST"), (":scheme", "http"), (":path", "/t.T/Sink"),
                           (":authority", "x"), ("content-type", "application/grpc"),
                           ("te", "trailers"), ("x-refuse", "open")]
                resets, statuses = {}, {}
                for stream_id in (1, 3, 5):  # 3 and 5: every field indexed, opened bare
                    conn.send_headers(stream_id, headers)
                    sock.sendall(conn.data_to_send())
                    while stream_id not in statuses:  # the refusal comes first
                        for event in conn.receive_data(sock.recv(65536)):
                            if isinstance(event, h2.events.TrailersReceived) or (
                                    isinstance(event, h2.events.ResponseReceived)
                                    and event.stream_ended):
                                statuses[event.stream_id] = dict(event.headers)
                            elif isinstance(event, h2.events.StreamReset):
                                resets[event.stream_id] = event.error_code
                        sock.sendall(conn.data_to_send())
                    # Bytes the client had in flight: sent on below h2 (h2 itself would
                    # refuse to send on a stream that was answered).
                    frame = (5).to_bytes(3, "big") + b"\0\1" + stream_id.to_bytes(4, "big")
                    sock.sendall(frame + b"\0\0\0\0\0")
                conn.ping(b"12345678")  # the server's answer to it comes after the rest
                sock.sendall(conn.data_to_send())
                acked = False
                while not acked:
                    for event in conn.receive_data(sock.recv(65536)):
                        acked |= isinstance(event, h2.events.PingAckReceived)
                        if isinstance(event, h2.events.StreamReset):
                            resets[event.stream_id] = event.error_code
                    sock.sendall(conn.data_to_send())
                sock.close()
                return statuses, resets

            statuses, resets = await asyncio.to_thread(talk)
            for stream_id in (1, 3, 5):
                assert statuses[stream_id][b"grpc-status"] == b"8", statuses  # RESOURCE_EXHAUSTED
                assert statuses[stream_id][b"grpc-message"] == b"refused at once"
            assert not [s for s, code in resets.items() if code != 0], resets
            assert await channel.unary_unary("/t.T/Echo")(b"ok") == b"ok"

    run(body())
