"""What a step costs per array it takes and makes: a program over N small donated arrays.

    python bench/many_arrays.py [N ...]                       # local jax
    isthmus run --devices 1 -- python bench/many_arrays.py 10 100 300

A real model's step takes every parameter and optimizer state as an array of its own and
makes as many (a language model's AdamW step: hundreds), so what isthmus spends per array,
not per call, bounds it. For each N: N float32[16] arrays updated by one jitted step that
donates them, pipelined (5 rounds of 100 steps, median steps/s), then 50 steps each followed
by reading a scalar (p50 ms, as a loop that logs its loss), and the client process's CPU
share while pipelining (the rest of a step through isthmus is the server's). The slope of
the time a step against N is the cost of one array.
"""

from __future__ import annotations

import statistics
import sys
import time


def measure(n: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    def update(params, x):
        new = [p * 0.999 + x for p in params]
        return new, sum(jnp.sum(p) for p in new[:4])

    step = jax.jit(update, donate_argnums=0)
    params = [jnp.full((16,), float(i)) for i in range(n)]
    x = jnp.float32(0.001)
    for _ in range(20):
        params, loss = step(params, x)
    jax.block_until_ready(params)
    rates = []
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            params, loss = step(params, x)
        jax.block_until_ready(params)
        rates.append(100 / (time.perf_counter() - start))
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    reads = []
    for _ in range(50):
        start = time.perf_counter()
        params, loss = step(params, x)
        float(loss)
        reads.append(time.perf_counter() - start)
    return {"arrays": n, "steps_per_s": statistics.median(rates),
            "us_per_step": 1e6 / statistics.median(rates),
            "step_and_read_p50_ms": statistics.median(reads) * 1e3, "client_cpu_share": share}


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [10, 100, 300]
    rows = [measure(n) for n in sizes]
    print(f"{'arrays':>7} {'steps/s':>9} {'us/step':>9} {'step+read p50 ms':>17} "
          f"{'client CPU':>11}")
    for row in rows:
        print(f"{row['arrays']:>7} {row['steps_per_s']:>9.0f} {row['us_per_step']:>9.0f} "
              f"{row['step_and_read_p50_ms']:>17.2f} {row['client_cpu_share']:>11.2f}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        slope = (last["us_per_step"] - first["us_per_step"]) / (last["arrays"] - first["arrays"])
        print(f"one array costs {slope:.2f} us a step (the slope from {first['arrays']} to "
              f"{last['arrays']} arrays)")


if __name__ == "__main__":
    main()
