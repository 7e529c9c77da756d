"""bench/threshold.py's loop with each window's times: when its 10 steps were dispatched and
when the client's wait for the window before ended. Prints one JSON line per size.

    python bench/phases/windows.py SIZES SECONDS [--on-device] [--threads OUT]

`--on-device` makes the matrices with jnp on the device instead of putting them from the
host, so that no transfer of the client's bytes is in the run. `--threads OUT` samples the
CPU of each thread of this process's parent (the server of `isthmus run`) into OUT while it
runs (bench/phases/threads.py).
"""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

WINDOW = 10  # steps dispatched before waiting for the last of the window before


def windows(n: int, seconds: float, on_device: bool) -> tuple[float, list]:
    if on_device:
        w = jnp.eye(n, dtype=jnp.float32) * 0.5 + 0.01
        x = jnp.ones((n, n), jnp.float32)
    else:
        w = jax.device_put(np.eye(n, dtype=np.float32) * 0.5 + 0.01)
        x = jax.device_put(np.ones((n, n), np.float32))

    @jax.jit
    def step(x):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    for _ in range(3):
        x = step(x)
    x.block_until_ready()
    times, behind, steps = [], x, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        began = time.time()
        for _ in range(WINDOW):
            x = step(x)
        dispatched = time.time()
        behind.block_until_ready()
        times.append((began, dispatched, time.time()))
        behind, steps = x, steps + WINDOW
    x.block_until_ready()
    return (time.perf_counter() - start) / steps * 1e3, times


if __name__ == "__main__":
    if "--threads" in sys.argv:
        subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "threads.py"),
                          str(os.getppid()), sys.argv[sys.argv.index("--threads") + 1]])
    for size in (int(s) for s in sys.argv[1].split(",")):
        ms, times = windows(size, float(sys.argv[2]), "--on-device" in sys.argv)
        print(json.dumps({"n": size, "ms": ms, "windows": times}), flush=True)
