"""Compile time of one program in a fresh client process (prints JSON).

    python bench/compile_cache.py [small|mlp]       (run by python -m bench, through a server)
    python -m bench.compile_cache [--rounds 3]       the persistent cache across a restart

Run twice against one server: the first run compiles cold, the second finds the program in
the server's compilation cache (jax's own in-process cache is empty in a new process).
`small` is a chain of 12 tanh layers; `mlp` is examples/train_mlp.py's training step over
every device (data parallel), the program issue 47 measured.

As a module it measures `--compile-cache` across a restart: per round, a fresh cache
directory, a server that compiles each program cold, then a new server on the same
directory that compiles it again; on the embedded backend and on a 1 x 2 x 1 fleet. It
prints the median milliseconds and the median ratio restart / cold of the rounds.
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).parent


def _small():
    import jax
    import jax.numpy as jnp

    def step(x, w):
        for _ in range(12):
            x = jnp.tanh(x @ w + jnp.sin(x))
        return jnp.sum(x * 0.123456)

    x = np.ones((256, 256), np.float32)
    return jax.jit(step).lower(x, x)


def _mlp():
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, str(HERE.parent / "examples"))
    import train_mlp

    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params = jax.device_put(train_mlp.init(jax.random.key(0), [16, 64, 64, 1]), replicated)
    n = 64 * len(jax.devices())
    x = jax.device_put(np.ones((n, 16), np.float32), batch)
    y = jax.device_put(np.ones((n, 1), np.float32), batch)
    return train_mlp.step.lower(params, x, y)


def main() -> None:
    lowered = {"small": _small, "mlp": _mlp}[sys.argv[1] if len(sys.argv) > 1 else "small"]()
    start = time.perf_counter()
    lowered.compile()
    print(json.dumps({"compile_ms": (time.perf_counter() - start) * 1e3}))


def restart(rounds: int) -> None:
    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    backends = {"embedded": {"devices": 2}, "fleet 1x2x1": {"devices": None,
                                                              "fleet": (1, 2, 1)}}
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(rounds):
        for backend, shape in backends.items():
            with tempfile.TemporaryDirectory(prefix="isthmus-bench-cache-") as cache:
                for phase in ("cold", "restart"):
                    with LocalServer(args=["--compile-cache", cache], **shape) as server:
                        env = child_environment(server.address, {
                            k: v for k, v in os.environ.items()
                            if k not in ("JAX_PLATFORMS", "XLA_FLAGS")})
                        for program in ("small", "mlp"):
                            out = subprocess.run(
                                [sys.executable, str(HERE / "compile_cache.py"), program],
                                env=env, capture_output=True, text=True, timeout=300)
                            if out.returncode:
                                raise RuntimeError(out.stderr[-3000:])
                            ms = json.loads(out.stdout.strip().splitlines()[-1])["compile_ms"]
                            times.setdefault((backend, program, phase), []).append(ms)
    print(f"--compile-cache across a restart, {rounds} rounds (median ms; ratio: median of "
          "the rounds' restart / cold)")
    print(f"  {'backend':12} {'program':8} {'cold':>8} {'restart':>8} {'ratio':>6}")
    for backend in backends:
        for program in ("small", "mlp"):
            cold = times[(backend, program, "cold")]
            again = times[(backend, program, "restart")]
            ratio = statistics.median(a / c for a, c in zip(again, cold))
            print(f"  {backend:12} {program:8} {statistics.median(cold):8.1f} "
                  f"{statistics.median(again):8.1f} {ratio:6.2f}")


if __name__ == "__main__":
    if __package__:  # python -m bench.compile_cache
        import argparse

        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--rounds", type=int, default=3)
        restart(parser.parse_args().rounds)
    else:
        main()
