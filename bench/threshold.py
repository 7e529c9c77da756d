"""The Pathways paper's metric, measured inside one client process (local jax or isthmus).

A training-like loop of jitted steps is dispatched without waiting (pipelined). Each step
chains `depth` matmuls of an n x n matrix, so its compute grows with n; with several devices
the rows of x are split over them (data parallel, no collectives). For each size we
report the step time and the steps per second; the driver divides isthmus's rate by local
jax's to find the smallest step at which isthmus keeps up.

    python bench/threshold.py SIZES DEPTH SECONDS [DEVICES [WARMUP]]

WARMUP (seconds, default 0): pipelined steps of each size run, unmeasured, before its
SECONDS are measured. On the TPU the embedded backend's server stops once for ~200 ms
about a second after a program starts running, and never again in that program's life
(bench/RESULTS.md, issue 49's eighth round): a steady-state curve warms each size past it.

Prints one JSON object: {"sizes": [...], "step_ms": [...], "steps_per_s": [...]}.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

WINDOW = 10


def pipelined(step, x, seconds: float) -> tuple[object, int]:
    """Steps from `x` for at least `seconds`, at most 2 x WINDOW in flight (as a training loop
    that reads its metrics a few steps late: dispatch runs ahead of compute, but not without
    bound). Returns the last output and the number of steps."""
    steps = 0
    start = time.perf_counter()
    behind = x
    while True:
        for _ in range(WINDOW):
            x = step(x)
        steps += WINDOW
        behind.block_until_ready()
        behind = x
        if time.perf_counter() - start > seconds:
            return x, steps


def measure(n: int, depth: int, min_seconds: float, devices: int,
            warmup: float = 0.0) -> tuple[float, float]:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    rows, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    w = jax.device_put(np.eye(n, dtype=np.float32) * 0.5 + 0.01, replicated)

    @jax.jit
    def step(x):
        for _ in range(depth):
            x = jnp.tanh(x @ w)
        return x

    x = jax.device_put(np.ones((n, n), np.float32), rows)
    for _ in range(3):
        x = step(x)
    x.block_until_ready()
    if warmup > 0:
        x, _ = pipelined(step, x, warmup)
        x.block_until_ready()
    start = time.perf_counter()
    x, steps = pipelined(step, x, min_seconds)
    x.block_until_ready()
    elapsed = time.perf_counter() - start
    return elapsed / steps * 1e3, steps / elapsed


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    depth = int(sys.argv[2])
    min_seconds = float(sys.argv[3])
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    warmup = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    step_ms, rates = [], []
    for n in sizes:
        ms, rate = measure(n, depth, min_seconds, devices, warmup)
        step_ms.append(ms)
        rates.append(rate)
    print(json.dumps({"sizes": sizes, "step_ms": step_ms, "steps_per_s": rates}))


if __name__ == "__main__":
    main()
