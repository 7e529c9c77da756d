"""Checkpoint bandwidth: orbax saving and restoring one array through the client (plain
orbax) and by the workers (pathwaysutils' persistence), on local jax, the embedded backend
and a fleet.

    python -m bench.checkpoints [--quick]

prints GB/s (medians of 3) for save and restore of a 256 MiB float32 array sharded over 8
devices (64 MiB with --quick), written to a temporary directory on this machine.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time


def client(size_mib: int, directory: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    if os.environ.get("ENABLE_PATHWAYS_PERSISTENCE") == "1":
        import pathwaysutils

        pathwaysutils.initialize()
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = NamedSharding(mesh, P("x"))
    n = size_mib * (1 << 20) // 4 // 1024
    array = jax.jit(lambda: jnp.arange(n * 1024, dtype=jnp.float32).reshape(n, 1024),
                    out_shardings=rows)()
    jax.block_until_ready(array)
    target = {"a": jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=rows)}
    saves, restores = [], []
    for i in range(3):
        path = os.path.join(directory, f"run{i}")
        ckptr = ocp.StandardCheckpointer()
        start = time.perf_counter()
        ckptr.save(path, {"a": array})
        ckptr.wait_until_finished()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        restored = ckptr.restore(path, target)
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - start)
        del restored
    gb = array.nbytes / 1e9
    return {"save_GBps": gb / statistics.median(saves),
            "restore_GBps": gb / statistics.median(restores)}


def main() -> int:
    import subprocess

    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    size = 64 if "--quick" in sys.argv else 256
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET",
                         "ENABLE_PATHWAYS_PERSISTENCE")}

    def run(env: dict[str, str]) -> dict:
        with tempfile.TemporaryDirectory(prefix="isthmus-bench-ckpt-") as directory:
            result = subprocess.run([sys.executable, __file__, "--client", str(size),
                                     directory], env=env, capture_output=True, text=True,
                                    timeout=1800)
        if result.returncode:
            raise RuntimeError(result.stderr[-4000:])
        return json.loads(result.stdout.strip().splitlines()[-1])

    rows = {"local jax": run({**base, "JAX_PLATFORMS": "cpu",
                              "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})}
    for name, shape in (("embedded", {"devices": 8}),
                        ("fleet 2x2x2", {"devices": None, "fleet": (2, 2, 2)})):
        with LocalServer(**shape) as server:
            env = child_environment(server.address, base)
            rows[f"isthmus {name}, through the client"] = run(
                {**env, "ENABLE_PATHWAYS_PERSISTENCE": "0"})
            rows[f"isthmus {name}, by the workers"] = run(
                {**env, "ENABLE_PATHWAYS_PERSISTENCE": "1"})
    print(f"orbax StandardCheckpointer, one {size} MiB float32 array over 8 devices "
          "(GB/s, medians of 3)")
    print(f"{'':44}{'save':>10}{'restore':>10}")
    for name, row in rows.items():
        print(f"{name:44}{row['save_GBps']:10.2f}{row['restore_GBps']:10.2f}")
    return 0


if __name__ == "__main__":
    if "--client" in sys.argv:
        at = sys.argv.index("--client")
        print(json.dumps(client(int(sys.argv[at + 1]), sys.argv[at + 2])))
        sys.exit(0)
    sys.exit(main())
