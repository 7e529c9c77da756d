"""Small sharded puts, as a data-parallel loop makes them (issue 10): a 256x16 float32 batch
`device_put` with a batch sharding over all the devices jax sees. The stock client uploads
every shard on a call of its own, so this measures the server's cost per host-buffer call.

Prints one JSON object: the synchronous put's median, pipelined puts per second, and (with
ISTHMUS_BENCH_SERVER_PID set to the server's pid) the server's CPU per put in each mode.

    python bench/sharded_put.py [PUTS]
"""

import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from client_metrics import cpu_seconds
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    server = os.environ.get("ISTHMUS_BENCH_SERVER_PID")
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    batch = np.random.default_rng(0).standard_normal((256, 16)).astype(np.float32)
    for _ in range(20):
        jax.device_put(batch, sharding).block_until_ready()
    cpu = cpu_seconds(server) if server else None
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.device_put(batch, sharding).block_until_ready()
        times.append(time.perf_counter() - t)
    cpu_sync = cpu_seconds(server) if server else None
    t = time.perf_counter()
    arrays = [jax.device_put(batch, sharding) for _ in range(n)]
    for a in arrays:
        a.block_until_ready()
    rate = n / (time.perf_counter() - t)
    cpu_end = cpu_seconds(server) if server else None
    print(json.dumps({
        "shards": len(jax.devices()),
        "sync_put_p50_ms": statistics.median(times) * 1e3,
        "pipelined_puts_per_s": rate,
        "server_cpu_ms_per_sync_put": None if cpu is None else (cpu_sync - cpu) / n * 1e3,
        "server_cpu_ms_per_pipelined_put": (None if cpu is None else
                                            (cpu_end - cpu_sync) / n * 1e3),
    }))


if __name__ == "__main__":
    main()
