"""What a machine charges for a round trip between two processes, with no isthmus and no jax:
a grpcio client and server over a Unix socket, 64-byte unary calls and a bidirectional
stream's ping-pong (the stock client's session is such a stream), p50 over N each.

    python bench/echo_floor.py [N]

Prints one JSON object, `unary_p50_ms` and `stream_p50_ms`. A wait of the stock client
(bench/round_trip.py's parts have one or two each) costs at least the stream's figure on
that machine, whatever the server does.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

PAYLOAD = b"x" * 64


def serve(path: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4))

    def stream(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
        yield from requests

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})])
    server.add_insecure_port(f"unix:{path}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def measure(path: str, n: int) -> dict[str, float]:
    channel = grpc.insecure_channel(f"unix:{path}")
    unary = channel.unary_unary("/Echo/Unary")
    times = []
    for _ in range(n + 100):  # the first 100 warm the channel
        start = time.perf_counter()
        unary(PAYLOAD, timeout=30)
        times.append(time.perf_counter() - start)
    out = {"unary_p50_ms": round(statistics.median(times[100:]) * 1e3, 3)}
    outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def requests() -> Iterator[bytes]:
        while (item := outgoing.get()) is not None:
            yield item

    answers = channel.stream_stream("/Echo/Stream")(requests(), timeout=300)
    times = []
    for _ in range(n + 100):
        start = time.perf_counter()
        outgoing.put(PAYLOAD)
        next(answers)
        times.append(time.perf_counter() - start)
    outgoing.put(None)
    channel.close()
    out["stream_p50_ms"] = round(statistics.median(times[100:]) * 1e3, 3)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "echo.sock")
        server = subprocess.Popen([sys.executable, __file__, "--serve", path],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise SystemExit("echo_floor.py: the echo server did not start")
            print(json.dumps(measure(path, n)), flush=True)
        finally:
            server.kill()
            server.wait(10)


if __name__ == "__main__":
    main()
