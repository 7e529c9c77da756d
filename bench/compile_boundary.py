"""Compile times through isthmus beside local jax: cold (a program the server has not seen),
warm (the same program again, from a fresh client: the server's executable cache) and a
real model's step (examples/train_mlp.py's, of a new width each run: cold), on the embedded
backend and the default fleet.

    python -m bench.compile_boundary [ROUNDS]

Each cold program is new to the server (its constant differs), so the figures include the
disposable process that parses, verifies and compiles a client's program first
(isthmus/controller/vetting.py), then the compile on the hosts. Medians of ROUNDS (default 5)
fresh client processes, each compiling PROGRAMS programs.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

from isthmus.testing import LocalServer, child_environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAMS = 4

CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
seed = int(sys.argv[2])

def timed(fn, *args):
    lowered = jax.jit(fn).lower(*args)
    start = time.perf_counter()
    lowered.compile()
    return (time.perf_counter() - start) * 1e3

def program(k):
    def f(x, w):
        for _ in range(12):
            x = jnp.tanh(x @ w + jnp.sin(x)) * (1.0 + k)
        return jnp.sum(x)
    return f

x = np.ones((256, 256), np.float32)
cold = [timed(program(seed * 100 + i), x, x) for i in range(int(sys.argv[3]))]
warm = [timed(program(0.5), x, x)]  # the same program every run: cached after the first
from examples import train_mlp
devices = jax.devices()
mesh = Mesh(np.array(devices), ("data",))
params = jax.device_put(train_mlp.init(jax.random.key(0), [16, 64 + seed, 64, 1]),
                        NamedSharding(mesh, P()))
batch = NamedSharding(mesh, P("data"))
xs = jax.device_put(np.ones((8 * len(devices), 16), np.float32), batch)
lowered = train_mlp.step.lower(params, xs, xs)
start = time.perf_counter()
lowered.compile()
mlp = (time.perf_counter() - start) * 1e3
print(json.dumps({"cold": sorted(cold)[len(cold) // 2],
                  "warm": warm[0], "mlp": mlp}))
"""


def _client(env: dict[str, str], seed: int) -> dict[str, float]:
    command = [sys.executable, "-c", CLIENT, str(ROOT), str(seed), str(PROGRAMS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def _base() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}


def measure(rounds: int) -> dict[str, dict[str, float]]:
    rows: dict[str, list[dict[str, float]]] = {}
    local = {**_base(), "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    rows["local jax (8 CPU devices)"] = [_client(local, r + 1) for r in range(rounds)]
    for name, kwargs in (("isthmus embedded (8 devices)", {"devices": 8}),
                         ("isthmus default fleet (2 x 4)", {"devices": None})):
        with LocalServer(**kwargs) as server:  # type: ignore[arg-type]
            env = child_environment(server.address, _base())
            rows[name] = [_client(env, r + 1) for r in range(rounds)]
    return {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for name, runs in rows.items()}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    table = measure(rounds)
    print(f"compile times, ms (median of {rounds} client processes; cold: median of "
          f"{PROGRAMS} new programs each)")
    print(f"{'':32} {'cold':>9} {'warm':>9} {'MLP step':>9}")
    for name, row in table.items():
        print(f"{name:32} {row['cold']:9.1f} {row['warm']:9.1f} {row['mlp']:9.1f}")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
