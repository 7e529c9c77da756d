"""Two slices driven at once by one program (issue 27): the slice-to-slice weight copy and the
overlap of examples/rl_loop.py's learner and sampler.

    isthmus run --slices 2 --hosts-per-slice 1 --devices-per-host 4 -- python bench/slices.py

- `weight_copy_GBps`: `jax.device_put` of a 64 MiB float32 array, replicated over slice 0's
  devices, to slice 1's devices (replicated there too), until ready; the array's bytes over
  the median time (each target device receives all of them);
- `learner_s`, `sampler_s`, `both_s`: one round of the RL loop's learner (K steps on slice 0)
  alone, the sampler's round (K batches on slice 1) alone, and both at once from two threads
  as examples/rl_loop.py runs them (medians);
- `overlap`: (learner_s + sampler_s) / both_s, 1.0 when nothing overlaps, 2.0 when the two
  slices hide each other completely.

Prints one JSON object. On local jax (no slices) the devices are split in two.
"""

import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

os.environ.setdefault("RL_HIDDEN", "512")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import rl_loop  # the example's model, after RL_HIDDEN is set


def main() -> None:
    quick = "--quick" in sys.argv
    first, second = rl_loop.two_slices(jax.devices())
    learner = NamedSharding(Mesh(np.array(first), ("d",)), P())
    sampler = NamedSharding(Mesh(np.array(second), ("d",)), P())
    out: dict[str, float] = {}

    weights = jax.device_put(np.ones((64 << 20) // 4, np.float32), learner)
    jax.block_until_ready(jax.device_put(weights, sampler))
    copies = []
    for _ in range(3 if quick else 8):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(weights, sampler))
        copies.append(time.perf_counter() - start)
    out["weight_copy_GBps"] = weights.nbytes / statistics.median(copies) / 1e9
    del weights

    params = jax.device_put(rl_loop.init(jax.random.key(0)), learner)
    acting = jax.device_put(params, sampler)
    steps = rl_loop.STEPS

    def sample_round(r):
        return jax.block_until_ready(
            [rl_loop.sample(acting, np.int32(r * steps + i)) for i in range(steps)])

    experience = [(jax.device_put(o, learner), jax.device_put(b, learner))
                  for o, b in sample_round(0)]

    def learn_round():
        p = params
        for obs, best in experience:
            p, _ = rl_loop.learn(p, obs, best)
        return jax.block_until_ready(p)

    learn_round()  # compile both
    pool = concurrent.futures.ThreadPoolExecutor(1)
    alone_l, alone_s, both = [], [], []
    for r in range(3 if quick else 7):
        start = time.perf_counter()
        learn_round()
        alone_l.append(time.perf_counter() - start)
        start = time.perf_counter()
        sample_round(r)
        alone_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        made = pool.submit(sample_round, r)
        learn_round()
        made.result()
        both.append(time.perf_counter() - start)
    out["learner_s"] = statistics.median(alone_l)
    out["sampler_s"] = statistics.median(alone_s)
    out["both_s"] = statistics.median(both)
    out["overlap"] = statistics.median(
        (a + b) / c for a, b, c in zip(alone_l, alone_s, both))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
