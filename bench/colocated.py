"""Colocated Python: the round trip of one call, and a training loop fed by a colocated loader.

    python -m bench.colocated [--quick]

runs the same client (this file, as a script) on local jax (where colocated_python calls the
function in the client process), through an embedded isthmus server, through a local fleet
of 2 slices x 2 hosts x 2 devices, and through the same fleet serving its devices as
accelerators with colocated CPU devices (ISTHMUS_ACCELERATOR_STAND_IN, the model of a GPU
fleet), and prints one table of medians:

- `call_1MiB_roundtrip_ms`: a call on a 1 MiB array that returns it, until it is ready
  (specialized, so every call is asynchronous; p50 of many);
- `loop_client_batches_steps_per_s`: a small data-parallel training step fed with batches
  made in the client (`device_put` of numpy arrays each step);
- `loop_colocated_loader_steps_per_s`: the same loop fed by a colocated loader class that
  makes each batch on the hosts of the mesh (on their colocated CPU devices, from which
  `jax.device_put` moves it to the loop's devices);
- `loader_vs_client_batches`: the ratio of the two loops (1.0: the loader costs nothing).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def client(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import colocated_python as cp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    # The loop trains on jax.devices(); the loader and the echo run on their colocated CPU
    # devices (the same devices on a CPU fleet, the CPU beside each accelerator otherwise).
    devices = cp.colocated_cpu_devices(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    cpu_mesh = Mesh(np.array(devices), ("x",))
    cpu_rows, cpu_replicated = NamedSharding(cpu_mesh, P("x")), NamedSharding(cpu_mesh, P())
    out: dict[str, float] = {}

    @cp.colocated_python
    def echo(x):
        return x

    echo = echo.specialize(out_specs_fn=lambda x: x)
    x = jax.device_put(np.ones(1 << 18, np.float32), devices[0])  # 1 MiB
    jax.block_until_ready(echo(x))
    times = []
    for _ in range(30 if quick else 200):
        start = time.perf_counter()
        jax.block_until_ready(echo(x))
        times.append(time.perf_counter() - start)
    out["call_1MiB_roundtrip_ms"] = statistics.median(times) * 1e3

    batch, features = 256, 64

    def make_batch(step):
        rng = np.random.default_rng(step)
        x = rng.standard_normal((batch, features), dtype=np.float32)
        return x, x[:, :1] * 0.5

    @cp.colocated_python_class
    class Loader:
        def __init__(self, sharding):
            self.sharding, self.step = sharding, 0

        def next(self, token):
            x, y = make_batch(self.step)
            self.step += 1
            return (jax.make_array_from_callback(x.shape, self.sharding, lambda i: x[i]),
                    jax.make_array_from_callback(y.shape, self.sharding, lambda i: y[i]))

    @jax.jit
    def step(params, x, y):
        def loss(p):
            h = jnp.tanh(x @ p[0])
            return jnp.mean((h @ p[1] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    def loop(next_batch, steps):
        params = jax.device_put((jnp.ones((features, 64)) * 0.01, jnp.ones((64, 1)) * 0.01),
                                replicated)
        params, loss = step(params, *next_batch(0))  # compile, discover specs
        jax.block_until_ready(loss)
        start = time.perf_counter()
        for i in range(1, steps + 1):
            params, loss = step(params, *next_batch(i))
            if i % 10 == 0:
                float(loss)
        float(loss)
        return steps / (time.perf_counter() - start)

    loader = Loader(cpu_rows)
    token = jax.device_put(np.zeros(()), cpu_replicated)
    steps = 30 if quick else 150
    client_rates, loader_rates = [], []
    for _ in range(3):
        client_rates.append(loop(lambda i: jax.device_put(make_batch(i), rows), steps))
        loader_rates.append(loop(lambda i: jax.device_put(loader.next(token), rows), steps))
    out["loop_client_batches_steps_per_s"] = statistics.median(client_rates)
    out["loop_colocated_loader_steps_per_s"] = statistics.median(loader_rates)
    out["loader_vs_client_batches"] = statistics.median(
        a / b for a, b in zip(loader_rates, client_rates))
    return out


def main() -> int:
    import os
    import subprocess

    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    quick = "--quick" in sys.argv
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}
    args = [sys.executable, __file__, "--client"] + (["--quick"] if quick else [])

    def run(env: dict[str, str]) -> dict:
        result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
        if result.returncode:
            raise RuntimeError(result.stderr[-4000:])
        return json.loads(result.stdout.strip().splitlines()[-1])

    columns = {"local jax": run({**base, "JAX_PLATFORMS": "cpu",
                                 "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})}
    with LocalServer(devices=8) as server:
        columns["isthmus embedded"] = run(child_environment(server.address, base))
    with LocalServer(devices=None, fleet=(2, 2, 2)) as server:
        columns["isthmus fleet 2x2x2"] = run(child_environment(server.address, base))
    # The same fleet served as accelerators, each with a colocated CPU device (the model of
    # a GPU fleet): the loader's batches move from those to the accelerators every step.
    from isthmus.worker.platforms import STAND_IN_ENV

    with LocalServer(devices=None, fleet=(2, 2, 2), env={**os.environ, STAND_IN_ENV: "1"}
                     ) as server:
        columns["fleet, accelerators"] = run(child_environment(server.address, base))
    print(f"colocated Python, 8 devices ({'quick' if quick else 'full'} mode; medians)")
    print(f"{'metric':36}" + "".join(f"{c:>20}" for c in columns))
    for key in next(iter(columns.values())):
        print(f"{key:36}" + "".join(f"{row[key]:20.3f}" for row in columns.values()))
    return 0


if __name__ == "__main__":
    if "--client" in sys.argv:
        print(json.dumps(client("--quick" in sys.argv)))
        sys.exit(0)
    sys.exit(main())
