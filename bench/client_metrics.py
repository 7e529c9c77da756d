"""Measured inside a client process (through isthmus, or on local jax).

Prints one JSON object. Medians and percentiles over many repetitions; the machine is shared.
"""

import json
import os
import statistics
import sys
import time

import jax
import numpy as np


def cpu_seconds(pid):
    """User + system CPU time of a process (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(quick: bool) -> None:
    reps = 300 if quick else 1000
    f = jax.jit(lambda a: a + 1)
    x = jax.device_put(np.float32(1))
    f(x).block_until_ready()
    sync = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        sync.append(time.perf_counter() - t)
    small = jax.device_put(np.ones(64, np.float32))
    g = jax.jit(lambda a: a * 2)
    np.asarray(g(small))
    fetch = []
    for _ in range(reps):
        t = time.perf_counter()
        np.asarray(g(small))
        fetch.append(time.perf_counter() - t)
    # Pipelined calls: 3,000 in quick mode too. 300 took 25-35 ms, and a change to the
    # tiny-call path read as 14k against 9k calls/s where 5 s windows showed no difference.
    n = 3000
    y = x
    for _ in range(20):
        y = f(y)
    y.block_until_ready()
    server = os.environ.get("ISTHMUS_BENCH_SERVER_PID")
    cpu_before = cpu_seconds(server) if server else None
    t = time.perf_counter()
    for _ in range(n):
        y = f(y)
    y.block_until_ready()
    rate = n / (time.perf_counter() - t)
    cpu_after = cpu_seconds(server) if server else None
    spread = spread_program(n) if len(jax.devices()) >= 4 else {}
    size = (64 if quick else 256) << 20
    data = np.ones(size // 4, np.float32)
    puts, gets, put_cpu, get_cpu = [], [], [], []
    for _ in range(2 if quick else 4):
        c = cpu_seconds(server) if server else None
        t = time.perf_counter()
        arr = jax.device_put(data)
        arr.block_until_ready()
        puts.append(time.perf_counter() - t)
        c2 = cpu_seconds(server) if server else None
        t = time.perf_counter()
        np.asarray(arr)
        gets.append(time.perf_counter() - t)
        if c is not None and c2 is not None:
            put_cpu.append(c2 - c)
            get_cpu.append(cpu_seconds(server) - c2)
        arr.delete()
    print(json.dumps({
        "jit_block_p50_ms": statistics.median(sync) * 1e3,
        "jit_block_p90_ms": percentile(sync, 0.9) * 1e3,
        "jit_fetch_p50_ms": statistics.median(fetch) * 1e3,
        "jit_fetch_p90_ms": percentile(fetch, 0.9) * 1e3,
        "pipelined_calls_per_s": rate,
        "controller_cpu_us_per_call": (None if cpu_before is None else
                                        (cpu_after - cpu_before) / n * 1e6),
        **spread,
        f"put_{size >> 20}MiB_GBps": size / statistics.median(puts) / 1e9,
        f"fetch_{size >> 20}MiB_GBps": size / statistics.median(gets) / 1e9,
        f"controller_cpu_ms_per_{size >> 20}MiB_put": (
            statistics.median(put_cpu) * 1e3 if put_cpu else None),
        f"controller_cpu_ms_per_{size >> 20}MiB_fetch": (
            statistics.median(get_cpu) * 1e3 if get_cpu else None),
    }))


def spread_program(n: int) -> dict:
    """Pipelined calls of a program over 4 devices (on the 2x2 fleet: over its 4 workers),
    with the CPU each call costs the controller and, on average, each worker."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    f = jax.jit(lambda a: a + 1)
    y = jax.device_put(np.zeros((4, 8), np.float32), NamedSharding(mesh, P("d")))
    for _ in range(20):
        y = f(y)
    y.block_until_ready()
    server = os.environ.get("ISTHMUS_BENCH_SERVER_PID")
    workers = [p for p in os.environ.get("ISTHMUS_BENCH_WORKER_PIDS", "").split(",") if p]
    before = [cpu_seconds(p) for p in [server, *workers] if p]
    t = time.perf_counter()
    for _ in range(n):
        y = f(y)
    y.block_until_ready()
    rate = n / (time.perf_counter() - t)
    after = [cpu_seconds(p) for p in [server, *workers] if p]
    result = {"pipelined_4dev_calls_per_s": rate}
    if server and None not in before + after:
        result["controller_cpu_us_per_4dev_call"] = (after[0] - before[0]) / n * 1e6
        if workers:
            result["worker_cpu_us_per_4dev_call"] = statistics.mean(
                a - b for a, b in zip(after[1:], before[1:])) / n * 1e6
    return result


if __name__ == "__main__":
    main("--quick" in sys.argv)
