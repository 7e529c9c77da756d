"""python -m bench.frames: what one small frame costs on a grpc.aio stream and on the plain
asyncio TCP stream the fleet's control plane uses (`isthmus/transport/frames.py`), and what
encoding and decoding a message costs in the fleet's codec and in pickle.

A sender process writes N frames of 200 bytes (a few per event-loop turn, as the controller
does) to a receiver process; each side's CPU time per frame is read from getrusage. Prints
one table; no figure is a test assertion.
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import time

FRAMES = 20_000
PAYLOAD = b"x" * 200


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _grpc_receiver() -> None:
    import grpc
    import grpc.aio

    async def connect(frames, context):
        count = 0
        async for _ in frames:
            count += 1
            if count == FRAMES:
                break
        yield json.dumps({"cpu_s": _cpu() - start}).encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Frames", {"Connect": grpc.stream_stream_rpc_method_handler(connect)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    start = _cpu()
    print(port, flush=True)
    await server.wait_for_termination()


async def _grpc_sender(port: int) -> dict:
    import grpc.aio

    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def frames():
        while (frame := await queue.get()) is not None:
            yield frame

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/bench.Frames/Connect")(frames())
        start = _cpu()
        for i in range(FRAMES):
            queue.put_nowait(PAYLOAD)
            if i % 4 == 3:
                await asyncio.sleep(0)
        async for answer in call:
            sent = _cpu() - start
            queue.put_nowait(None)
            return {"sender_us": sent / FRAMES * 1e6,
                    "receiver_us": json.loads(answer)["cpu_s"] / FRAMES * 1e6}
    raise RuntimeError("the receiver did not answer")


async def _tcp_receiver() -> None:
    from isthmus.transport.frames import read_frame, write_frame

    async def serve(reader, writer):
        for _ in range(FRAMES):
            await read_frame(reader)
        write_frame(writer, json.dumps({"cpu_s": _cpu() - start}).encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    start = _cpu()
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


async def _tcp_sender(port: int) -> dict:
    from isthmus.transport.frames import read_frame, write_frame

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = _cpu()
    for i in range(FRAMES):
        write_frame(writer, PAYLOAD)
        if i % 4 == 3:
            await asyncio.sleep(0)
    answer = json.loads(await read_frame(reader))
    sent = _cpu() - start
    writer.close()
    return {"sender_us": sent / FRAMES * 1e6, "receiver_us": answer["cpu_s"] / FRAMES * 1e6}


def _measure(kind: str) -> dict:
    receiver = subprocess.Popen([sys.executable, "-m", "bench.frames", "--receive", kind],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        began = time.monotonic()
        sender = _grpc_sender if kind == "grpc.aio" else _tcp_sender
        result = asyncio.run(asyncio.wait_for(sender(port), 120))
        result["wall_us"] = (time.monotonic() - began) / FRAMES * 1e6
        return result
    finally:
        receiver.kill()
        receiver.wait(10)


def codec_rows(repeat: int = 20_000) -> dict[str, dict[str, float]]:
    """µs to encode and decode a typical command batch: the fleet's codec against pickle."""
    import pickle
    import timeit

    from isthmus.transport import commands as c
    from isthmus.transport import messages as m

    batch = m.Batch((c.Execute(3, (7, (8, 9)), (10,), frozenset()), c.Free(range(4, 8))))
    shared = m.Batch((m.Shared(m.encode((c.Execute(3, (7,), (10,), frozenset()),))),))
    rows = {}
    for name, value in (("a batch of Execute + Free", batch), ("a shared frame", shared)):
        rows[name] = {
            "codec_us": timeit.timeit(lambda v=value: m.decode(m.encode(v)),
                                      number=repeat) / repeat * 1e6,
            "pickle_us": timeit.timeit(lambda v=value: pickle.loads(pickle.dumps(v, 5)),
                                       number=repeat) / repeat * 1e6}
    return rows


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--receive":
        asyncio.run(_grpc_receiver() if sys.argv[2] == "grpc.aio" else _tcp_receiver())
        return 0
    results = {kind: _measure(kind) for kind in ("grpc.aio", "asyncio TCP")}
    print(f"{FRAMES} frames of {len(PAYLOAD)} bytes, CPU per frame:")
    print(f"{'stream':14}{'sender µs':>12}{'receiver µs':>14}{'wall µs':>10}")
    for kind, r in results.items():
        print(f"{kind:14}{r['sender_us']:12.1f}{r['receiver_us']:14.1f}{r['wall_us']:10.1f}")
    print("\nencode + decode of one message, µs:")
    print(f"{'message':28}{'fleet codec':>12}{'pickle':>10}")
    for name, r in codec_rows().items():
        print(f"{name:28}{r['codec_us']:12.1f}{r['pickle_us']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
