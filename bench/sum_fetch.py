"""A cross-host reduction read back, as a training loop reads its loss (issue 27): a (256, 16)
float32 batch sharded over all the devices jax sees, `jnp.sum` of it with and without the
fetch (`float(...)`), and an elementwise program with and without fetching its 8 shards.

Prints one JSON object of medians in ms. Run it through a fleet, e.g.

    isthmus run --slices 1 --hosts-per-slice 2 --devices-per-host 4 -- \
        python bench/sum_fetch.py [REPS]
"""

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    x = jax.device_put(
        np.random.default_rng(0).standard_normal((256, 16)).astype(np.float32), sharding)
    total = jax.jit(jnp.sum)
    elementwise = jax.jit(lambda a: a * 2 + 1)
    for _ in range(100):
        float(total(x))
        elementwise(x).block_until_ready()
    times: dict[str, list[float]] = {"sum": [], "sum_fetch": [], "elementwise": [],
                                     "elementwise_fetch": []}
    for _ in range(reps):
        t = time.perf_counter()
        total(x).block_until_ready()
        times["sum"].append(time.perf_counter() - t)
        t = time.perf_counter()
        float(total(x))
        times["sum_fetch"].append(time.perf_counter() - t)
        t = time.perf_counter()
        elementwise(x).block_until_ready()
        times["elementwise"].append(time.perf_counter() - t)
        t = time.perf_counter()
        np.asarray(elementwise(x))
        times["elementwise_fetch"].append(time.perf_counter() - t)
    print(json.dumps({f"{k}_ms": round(statistics.median(v) * 1e3, 3)
                      for k, v in times.items()}))


if __name__ == "__main__":
    main()
