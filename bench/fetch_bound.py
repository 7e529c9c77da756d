"""Where a large transfer's time goes (issue 27, item 4; issue 40, item 2): the stock
client's put and `np.asarray` of a 256 MiB array through isthmus, beside what any client
must do with those bytes on this machine, and the machine facts the two depend on.

    python -m bench.fetch_bound [SIZE_MIB] [ROUNDS] [TRANSFERS]

Facts: kernel, cores, memory, transparent huge pages (THP) and their defrag mode, glibc and
GLIBC_TUNABLES. Rows (GB/s of the array's bytes; medians of ROUNDS, each in a fresh child
process, so that no page is warm that a real transfer would find cold):

- `first touch (numpy: huge pages)`: `np.empty` + fill (numpy asks for huge pages from 4 MiB);
- `copy, warm` / `copy, cold`: one memcpy into pages already touched / into a fresh array;
- `client's two copies, no transport`: the copies the stock client makes of a fetch once its
  bytes are in (`Cord::Flatten` into one malloc'd block, then into the array jax returns),
  into fresh memory, with no gRPC at all: the client-only bound;
- `client's put copies, no transport`: those of a put over the socket (the whole array into a
  malloc'd block, as `kImmutableOnlyDuringCall` asks, then each 1 MiB chunk into its
  message), into fresh memory: the put's client-only bound;
- `first touch, malloc` and `the same block again`: a malloc'd block of the whole size
  (glibc maps it fresh, in 4 KiB pages) filled, freed, and a second one; `, huge pages`:
  the same with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`;
- `grpc stream, TCP` / `, Unix socket`: a Python grpc client (grpcio's C core, as in the
  stock client) receiving the bytes in 1 MiB messages from a grpc server that sends a
  prepared buffer (TCP where this machine allows it);
- the stock client through isthmus, embedded and on a 1x1x1 fleet, over the socket and with
  the shared-memory variables `isthmus run` sets, and (embedded) with the client's glibc
  malloc keeping its memory and using huge pages (`KEPT`): put and fetch, the first of a
  process apart from the median of the TRANSFERS - 1 (default 5) after it, and the server's
  (controller's) CPU for a fetch as GB/s of its CPU time.

Prints one table and one JSON line. No row is a test assertion.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

# glibc tunables for the client: no mmap'd blocks (a large block freed stays in the heap, so
# the next transfer reuses pages already touched), no trimming, huge pages for the heap.
KEPT = ("glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:"
        "glibc.malloc.hugetlb=1")
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
elif kind == "touch_malloc":  # malloc'd pages, as the stock client's own buffers are
    import ctypes
    libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p
    rates = []
    for _ in range(2):  # a fresh block, then (where the allocator keeps it) the same again
        p = libc.malloc(size)
        a = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(p))
        t = time.perf_counter(); a.fill(1); rates.append(size / (time.perf_counter() - t) / 1e9)
        del a; libc.free(ctypes.c_void_p(p))
    print(json.dumps(rates))
elif kind == "client_copies":  # the stock client's two copies of a fetch, no transport
    import ctypes
    libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p
    received = np.ones(size, np.uint8)  # the received pieces (reused memory, warm)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        p = libc.malloc(size)  # Cord::Flatten: a malloc'd block of the whole size
        flat = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(p))
        flat[:] = received
        out = np.empty(size, np.uint8); out[:] = flat  # into the array jax hands back
        rates.append(size / (time.perf_counter() - t) / 1e9)
        del flat, out; libc.free(ctypes.c_void_p(p))
    print(json.dumps(sorted(rates)[1]))
elif kind == "client_put":  # the stock client's copies of a put, no transport
    import ctypes
    libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p
    source = np.ones(size, np.uint8)  # the caller's array (touched)
    message = np.empty(1 << 20, np.uint8); message.fill(0)  # a 1 MiB message, reused
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        p = libc.malloc(size)  # kImmutableOnlyDuringCall: a copy of the whole array
        held = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(p))
        held[:] = source
        for start in range(0, size, 1 << 20):  # each chunk into its message
            piece = held[start:start + (1 << 20)]; message[:len(piece)] = piece
        rates.append(size / (time.perf_counter() - t) / 1e9)
        del held; libc.free(ctypes.c_void_p(p))
    print(json.dumps(sorted(rates)[1]))
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
elif kind == "stock":  # put and fetch through the stock client: the first, then 5 more
    import jax
    x = np.ones(size // 4, np.float32)
    server = int(sys.argv[3])
    def server_cpu():
        with open(f"/proc/{server}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100
    step = jax.jit(lambda a: a + 1)
    puts, fetches, cpu = [], [], []
    for i in range(int(sys.argv[4])):
        t = time.perf_counter(); a = jax.device_put(x); a.block_until_ready()
        puts.append(size / (time.perf_counter() - t) / 1e9)
        y = step(a); y.block_until_ready(); del a
        c = server_cpu(); t = time.perf_counter(); np.asarray(y); took = time.perf_counter() - t
        fetches.append(size / took / 1e9); cpu.append(size / max(server_cpu() - c, 0.01) / 1e9)
        del y
    median = lambda v: sorted(v)[len(v) // 2]
    print(json.dumps({"put first": puts[0], "put": median(puts[1:]),
                      "fetch first": fetches[0], "fetch": median(fetches[1:]),
                      "server GB/s of CPU": median(cpu[1:])}))
"""


def _child(args: list[str], env: dict[str, str] | None = None) -> object:
    result = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True,
                            text=True, timeout=600, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def _grpc_server(size: int, unix: str | None = None) -> tuple[object, str]:
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
    if unix is not None:
        server.add_insecure_port(f"unix:{unix}")
        server.start()
        return server, f"unix:{unix}"
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def machine_facts() -> dict[str, str]:
    """What a large transfer's speed depends on here, beside the figures."""
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "-"
    memory = read("/proc/meminfo").splitlines()
    return {"kernel": os.uname().release,
            "cores": str(os.cpu_count()),
            "memory": memory[0].split(":", 1)[1].strip() if memory else "-",
            "transparent huge pages": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "THP defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "glibc": os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "-",
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "(unset)")}


def _stock(env: dict[str, str], size: int, pid: int, rounds: int, repeats: int
           ) -> dict[str, float]:
    runs = [_child(["stock", str(size), str(pid), str(repeats)], env=env)
            for _ in range(rounds)]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}  # type: ignore[index, union-attr]


def main() -> int:
    size = (int(sys.argv[1]) if len(sys.argv) > 1 else 256) << 20
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    facts = machine_facts()
    rows: dict[str, float] = {}
    for name, kind in (("first touch (numpy: huge pages)", "touch"),
                       ("copy, warm", "copy_warm"), ("copy, cold", "copy_cold"),
                       ("client's two copies, no transport", "client_copies"),
                       ("client's put copies, no transport", "client_put")):
        rows[name] = statistics.median(float(_child([kind, str(size)]))  # type: ignore[arg-type]
                                       for _ in range(rounds))
    for label, tunables in (("", None), (", huge pages", "glibc.malloc.hugetlb=1")):
        env = dict(os.environ)
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        touches = [_child(["touch_malloc", str(size)], env=env) for _ in range(rounds)]
        rows[f"first touch, malloc{label}"] = statistics.median(t[0] for t in touches)  # type: ignore[index]
        rows[f"  the same block again{label}"] = statistics.median(t[1] for t in touches)  # type: ignore[index]
    import tempfile

    from isthmus.ports import tcp_available

    for label, unix in (("TCP", None), ("Unix socket", "grpc.sock")):
        if unix is None and not tcp_available():
            continue  # a sandbox without internet sockets
        with tempfile.TemporaryDirectory() as directory:
            server, address = _grpc_server(size, unix and os.path.join(directory, unix))
            try:
                rows[f"grpc stream, {label}"] = statistics.median(
                    float(_child(["grpc", str(size), address]))  # type: ignore[arg-type]
                    for _ in range(rounds))
            finally:
                server.stop(0)

    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}
    transfers: dict[str, dict[str, float]] = {}
    for where, kwargs in (("embedded", {"devices": 1}),
                          ("fleet 1x1x1", {"devices": None, "fleet": (1, 1, 1)})):
        with LocalServer(**kwargs) as isthmus:  # type: ignore[arg-type]
            assert isthmus.process is not None
            plain = child_environment(isthmus.address, base)
            # The shared-memory variables `isthmus run` sets: the client's large puts go
            # through files in the server's directory instead of the socket.
            shared = {**plain, SHARED_ENV[0]: isthmus.status()["shared_dir"],
                      SHARED_ENV[1]: str(1 << 20)}
            variants = [("socket", plain), ("shared memory", shared)]
            if where == "embedded":  # the client's allocator keeping and huge-paging memory
                variants.append(("socket, malloc kept (KEPT)", {**plain, "GLIBC_TUNABLES": KEPT}))
            for label, env in variants:
                transfers[f"{where}, {label}"] = _stock(env, size, isthmus.process.pid, rounds,
                                                             repeats)
    print(f"a {size >> 20} MiB transfer on this machine, GB/s (medians of {rounds}):")
    for name, value in facts.items():
        print(f"  {name:42} {value}")
    for name, value in rows.items():
        print(f"  {name:42} {value:8.2f}")
    keys = list(next(iter(transfers.values())))
    print(f"  {'stock client through isthmus':42}" + "".join(f"{k:>20}" for k in keys))
    for name, row in transfers.items():
        print(f"  {name:42}" + "".join(f"{row[k]:20.2f}" for k in keys))
    print(json.dumps({"facts": facts, "rows": rows, "transfers": transfers}))
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    sys.exit(code)
