"""What one dispatch costs on this machine's accelerator, and whether it lets go of the GIL.

    python bench/tpu_dispatch.py [--steps N]     # local jax, on the TPU machine (or any)

Two tables for the MLP step of bench/tpu_work.py (784-512-512-10, batch 128, SGD), pipelined:

- *per call*, microseconds a step (median of three rounds) through `jax.jit`, the compiled
  object, and jaxlib's `LoadedExecutable` calls a worker may make: `execute_sharded(...)
  .consume_with_handlers(...)` (what isthmus's hosts call for a program on one device),
  `execute`, and `execute_sharded(with_tokens=True)` with its disassembly;
- *the GIL*: steps/s with N us of pure Python beside each step, the step dispatched inline
  or from a second thread fed by the first. Where a dispatch lets go of the GIL the threaded
  column keeps up; where it holds it, the two columns match (a TPU v5e: they matched, so a
  second thread cannot take a server's enqueue off its main thread: issue 49's third round);
- *the drops*: the step through jaxlib's call as a worker makes it, the arrays each step
  replaces dropped inline (as a worker's `Free` does) or handed to a thread that drops them;
  and what dropping one array costs alone. Where the threaded drops keep a faster pace, a
  worker gains by dropping off its main thread.
"""

from __future__ import annotations

import pathlib
import queue
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))


def main() -> None:
    import jax
    from tpu_work import mlp_init, mlp_update

    from isthmus.compat import jax as jax_compat

    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 2000
    params = mlp_init([784, 512, 512, 10])
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((128, 784)).astype(np.float32))
    y = jax.device_put(np.eye(10, dtype=np.float32)[rng.integers(0, 10, 128)])
    step = jax.jit(mlp_update)
    compiled = step.lower(params, x, y).compile()
    executable = compiled.runtime_executable()
    leaves = jax.tree_util.tree_leaves((params, x, y))
    n_params = len(jax.tree_util.tree_leaves(params))
    device = jax.devices()[0]
    sharding = jax_compat.jaxlib_extension().SingleDeviceSharding(device)
    handlers = [jax_compat.result_handler(jax.core.ShapedArray(o.shape, o.dtype), sharding)
                for o in jax.tree_util.tree_leaves(compiled.out_info)]

    def through_jit(n: int, call=step) -> object:
        p, value = params, None
        for _ in range(n):
            p, value = call(p, x, y)
        return value

    def through_executable(n: int, how: str) -> object:
        values = list(leaves)
        for _ in range(n):
            if how == "handlers":
                outs = executable.execute_sharded(values).consume_with_handlers(handlers)
            elif how == "execute":
                outs = executable.execute(values)
            else:
                results = executable.execute_sharded(values, with_tokens=True)
                outs = [o[0] for o in results.disassemble_into_single_device_arrays()]
            values[:n_params] = outs[:n_params]
        return outs[-1]

    ways = {"jax.jit": through_jit,
            "compiled": lambda n: through_jit(n, compiled),
            "execute_sharded + handlers": lambda n: through_executable(n, "handlers"),
            "execute": lambda n: through_executable(n, "execute"),
            "execute_sharded, tokens": lambda n: through_executable(n, "tokens")}
    for way in ways.values():
        jax.block_until_ready(way(20))
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(3):
        for name, way in ways.items():
            start = time.perf_counter()
            jax.block_until_ready(way(steps))
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    print(f"{device.device_kind}: one MLP step dispatched, us (median of 3 rounds of {steps})")
    for name, values in times.items():
        print(f"  {name:30} {statistics.median(values):8.1f}")

    def python(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    def inline(us: float) -> float:
        p, value = params, None
        start = time.perf_counter()
        for _ in range(steps):
            python(us)
            p, value = step(p, x, y)
        jax.block_until_ready(value)
        return steps / (time.perf_counter() - start)

    def threaded(us: float) -> float:
        work: queue.SimpleQueue[bool] = queue.SimpleQueue()

        def dispatch() -> None:
            p, value = params, None
            while work.get():
                p, value = step(p, x, y)
            jax.block_until_ready(value)

        thread = threading.Thread(target=dispatch)
        thread.start()
        start = time.perf_counter()
        for _ in range(steps):
            python(us)
            work.put(True)
        work.put(False)
        thread.join()
        return steps / (time.perf_counter() - start)

    def dropping(n: int, on_thread: bool) -> float:
        values = list(leaves)
        doomed: queue.SimpleQueue[list[object] | None] = queue.SimpleQueue()

        def drop() -> None:
            while doomed.get() is not None:
                pass  # the batch's last reference goes here

        thread = threading.Thread(target=drop)
        thread.start()
        start = time.perf_counter()
        for _ in range(n):
            outs = executable.execute_sharded(values).consume_with_handlers(handlers)
            old = values[:n_params] + [None]
            values[:n_params] = outs[:n_params]
            if on_thread:
                doomed.put(old)
            del old
        jax.block_until_ready(outs[-1])
        elapsed = time.perf_counter() - start
        doomed.put(None)
        thread.join()
        return n / elapsed

    print(f"the drops: steps/s through execute_sharded + handlers (3 rounds of {steps})")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):
        for on_thread in (False, True, True, False):
            rates[on_thread].append(dropping(steps, on_thread))
    for on_thread, label in ((False, "dropped inline"), (True, "dropped on a thread")):
        print(f"  {label:30} {statistics.median(rates[on_thread]):8.0f}  "
              f"({', '.join(f'{r:.0f}' for r in rates[on_thread])})")
    batch = [jax.device_put(np.ones((512, 512), np.float32)) for _ in range(500)]
    jax.block_until_ready(batch)
    start = time.perf_counter()
    del batch[:]
    print(f"  dropping one computed 512 x 512 array alone: "
          f"{(time.perf_counter() - start) / 500 * 1e6:.1f} us")

    print("the GIL: steps/s with Python beside each step (best of 2)")
    print(f"  {'Python us':>10} {'inline':>10} {'threaded':>10}")
    for us in (0, 50, 100, 200, 300):
        print(f"  {us:>10} {max(inline(us) for _ in range(2)):>10.0f} "
              f"{max(threaded(us) for _ in range(2)):>10.0f}")


if __name__ == "__main__":
    main()
