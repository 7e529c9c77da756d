"""Large transfers through isthmus, timed one by one: puts of SIZE MiB
(`jax.device_put(x).block_until_ready()`) and fetches (`np.asarray` of a jit result).

Prints one JSON object: the median GB/s of each (without the first, which pays for fresh
memory on every side) and, with ISTHMUS_BENCH_SERVER_PID set to the server's pid, the
server's CPU per transfer.

    python bench/transfers.py [SIZE_MIB] [COUNT]
"""

import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from client_metrics import cpu_seconds


def main() -> None:
    size = (int(sys.argv[1]) if len(sys.argv) > 1 else 64) << 20
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    server = os.environ.get("ISTHMUS_BENCH_SERVER_PID")
    x = np.ones(size // 4, np.float32)
    step = jax.jit(lambda a, i: a + i)
    puts, fetches, put_cpu, fetch_cpu = [], [], [], []
    for i in range(count):
        c0 = cpu_seconds(server) if server else None
        t = time.perf_counter()
        a = jax.device_put(x)
        a.block_until_ready()
        puts.append(time.perf_counter() - t)
        y = step(a, i)
        y.block_until_ready()
        c1 = cpu_seconds(server) if server else None
        t = time.perf_counter()
        value = np.asarray(y)
        fetches.append(time.perf_counter() - t)
        c2 = cpu_seconds(server) if server else None
        assert value[0] == 1 + i
        if server:
            put_cpu.append(c1 - c0)
            fetch_cpu.append(c2 - c1)
        del a, y, value
    print(json.dumps({
        "size_MiB": size >> 20,
        "put_GBps": size / statistics.median(puts[1:] or puts) / 1e9,
        "fetch_GBps": size / statistics.median(fetches[1:] or fetches) / 1e9,
        "server_cpu_ms_per_put_and_step": (statistics.median(put_cpu[1:] or put_cpu) * 1e3
                                           if put_cpu else None),
        "server_cpu_ms_per_fetch": (statistics.median(fetch_cpu[1:] or fetch_cpu) * 1e3
                                    if fetch_cpu else None),
    }))


if __name__ == "__main__":
    main()
