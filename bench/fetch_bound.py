"""Where a large fetch's time goes (issue 27, item 4): the stock client's `np.asarray` of a
256 MiB array through isthmus, beside what any client must do to receive it on this machine.

    python -m bench.fetch_bound [SIZE_MIB] [ROUNDS]

Rows (GB/s of the array's bytes; medians of ROUNDS, each in a fresh child process where it
matters, so that no page is warm that a real fetch would find cold):

- `first touch`: `np.empty` + filling it: the page faults of a result nobody wrote yet;
- `copy, warm`: one memcpy into pages already touched;
- `copy, cold`: one memcpy into a fresh array (the copy a client makes of its receive buffer);
- `grpc stream`: a Python grpc client (grpcio's C core, as in the stock client) receiving
  the bytes in 1 MiB messages from a grpc server that sends a prepared buffer: the transport's
  own ceiling on this machine, copies and faults included;
- `stock client, embedded`: `np.asarray` of a computed 256 MiB array through an embedded
  isthmus server (the server's share and the client's together);
- `the server's CPU for it`: the array's bytes over the server's CPU seconds for that fetch;
- the same two with the shared-memory variables `isthmus run` sets (the client's large
  transfers through files in the server's directory).

Prints one table and one JSON line. No row is a test assertion.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

SHARED_ENV = ("IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY",
              "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES")

CHILD = r"""
import json, sys, time
import numpy as np
kind, size = sys.argv[1], int(sys.argv[2])
if kind == "touch":
    t = time.perf_counter(); a = np.empty(size, np.uint8); a.fill(1)
    print(json.dumps(size / (time.perf_counter() - t) / 1e9))
elif kind == "copy_warm":
    src = np.ones(size, np.uint8); dst = np.empty(size, np.uint8); dst.fill(0)
    t = time.perf_counter(); np.copyto(dst, src)
    print(json.dumps(size / (time.perf_counter() - t) / 1e9))
elif kind == "copy_cold":
    src = np.ones(size, np.uint8)
    t = time.perf_counter(); dst = src.copy()
    print(json.dumps(size / (time.perf_counter() - t) / 1e9))
elif kind == "grpc":
    import grpc
    channel = grpc.insecure_channel(sys.argv[3], options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    call = channel.unary_stream("/bench.Bytes/Get")
    t = time.perf_counter()
    out = np.empty(size, np.uint8); offset = 0
    for piece in call(b"", timeout=120):
        out[offset:offset + len(piece)] = np.frombuffer(piece, np.uint8); offset += len(piece)
    assert offset == size
    print(json.dumps(size / (time.perf_counter() - t) / 1e9))
elif kind == "stock":
    import jax
    x = np.ones(size // 4, np.float32)
    rates, cpu = [], []
    server = int(sys.argv[3])
    def server_cpu():
        with open(f"/proc/{server}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100
    step = jax.jit(lambda a: a + 1)
    for i in range(3):
        y = step(jax.device_put(x)); y.block_until_ready()
        c = server_cpu(); t = time.perf_counter(); np.asarray(y); took = time.perf_counter() - t
        rates.append(size / took / 1e9); cpu.append(size / max(server_cpu() - c, 0.01) / 1e9)
        del y
    print(json.dumps([sorted(rates)[1], sorted(cpu)[1]]))  # medians of 3
"""


def _child(args: list[str], env: dict[str, str] | None = None) -> object:
    result = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True,
                            text=True, timeout=600, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def _grpc_server(size: int) -> tuple[object, str]:
    from concurrent import futures

    import grpc
    import numpy as np

    data = np.ones(size, np.uint8).tobytes()
    pieces = [data[i:i + (1 << 20)] for i in range(0, size, 1 << 20)]

    def get(request: bytes, context: object):
        yield from pieces

    server = grpc.server(futures.ThreadPoolExecutor(2), options=[
        ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Bytes", {"Get": grpc.unary_stream_rpc_method_handler(get)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def main() -> int:
    size = (int(sys.argv[1]) if len(sys.argv) > 1 else 256) << 20
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rows: dict[str, float] = {}
    for name, kind in (("first touch", "touch"), ("copy, warm", "copy_warm"),
                       ("copy, cold", "copy_cold")):
        rows[name] = statistics.median(float(_child([kind, str(size)]))
                                       for _ in range(rounds))
    server, address = _grpc_server(size)
    try:
        rows["grpc stream"] = statistics.median(
            float(_child(["grpc", str(size), address])) for _ in range(rounds))
    finally:
        server.stop(0)

    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}
    with LocalServer(devices=1) as isthmus:
        assert isthmus.process is not None
        plain = child_environment(isthmus.address, base)
        # The shared-memory variables `isthmus run` sets: the client's large transfers go
        # through files in the server's directory instead of the socket.
        shared = {**plain, SHARED_ENV[0]: isthmus.status()["shared_dir"],
                  SHARED_ENV[1]: str(1 << 20)}
        for label, env in (("", plain), (", shared memory", shared)):
            stock, share = [], []
            for _ in range(rounds):
                rate, cpu = _child(["stock", str(size), str(isthmus.process.pid)],
                                   env=env)
                stock.append(rate)
                share.append(cpu)
            rows[f"stock client, embedded{label}"] = statistics.median(stock)
            rows[f"  the server's CPU for it{label}"] = statistics.median(share)
    print(f"a {size >> 20} MiB fetch on this machine, GB/s (medians of {rounds}):")
    for name, value in rows.items():
        print(f"  {name:42} {value:8.2f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    sys.exit(code)
