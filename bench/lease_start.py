"""What a shared service's safety costs a job at its start: grant to first program, the
renewal of a slice's workers after a lease that ran its own code, and a confined import.

    python -m bench.lease_start [ROUNDS]

On a shared service of 2 slices (1 host of 2 CPU devices each) whose workers confine
themselves (`worker/sandbox.py`), each round: a client process that has imported jax (and
waits) gets a lease; the time from the grant to its first program's result (a jit of a small
function on the lease's devices, compiled and run) is "grant to first program". The same
client against a plain fleet of the same shape (no lease, unconfined workers), from the
moment it is told the address, is the peer. Then the lease of a tenant allowed colocated
Python ends, and "renewal" is the time until its slice is free again with fresh workers
(`LocalLauncher.renew`). "import" is a fresh Python importing jax and running one op,
confined and not. Medians of ROUNDS (default 5).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from isthmus import shared
from isthmus.testing import LocalServer, child_environment, wait_until

CLIENT = r"""
import os, sys, time
import jax, jax.numpy as jnp
target = sys.stdin.readline().strip()
start = time.perf_counter()
jax.config.update("jax_backend_target", target)
os.environ["JAX_BACKEND_TARGET"] = target
x = jax.device_put(jnp.arange(16.0), jax.devices()[0])
float(jax.jit(lambda a: (a * a).sum())(x))
print("FIRST", time.perf_counter() - start, flush=True)
"""

IMPORT = r"""
import sys, time
start = time.perf_counter()
if sys.argv[1] == "confined":
    from isthmus.worker.sandbox import Sandbox, confine
    confine(Sandbox())
import jax, jax.numpy as jnp
float(jnp.sum(jnp.arange(4.0)))
print(time.perf_counter() - start)
"""


def _ready_client() -> subprocess.Popen[str]:
    env = child_environment("grpc://127.0.0.1:1", dict(os.environ))
    client = subprocess.Popen([sys.executable, "-c", CLIENT], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    time.sleep(3.0)  # its jax import is done by now (it is not what we time)
    return client


def _first(client: subprocess.Popen[str], target: str) -> float:
    assert client.stdin is not None
    start = time.perf_counter()
    client.stdin.write(target + "\n")
    client.stdin.flush()
    out, _ = client.communicate(timeout=120)
    if client.returncode != 0 or "FIRST" not in out:
        raise RuntimeError(f"the client failed: {out}")
    return time.perf_counter() - start


def main(rounds: int = 5) -> None:
    results: dict[str, list[float]] = {k: [] for k in (
        "grant to first program (shared, confined)", "connect to first program (plain fleet)",
        "renewal after a colocated tenant's lease", "import jax + one op, confined",
        "import jax + one op, not confined")}
    with tempfile.TemporaryDirectory() as directory:
        for name in ("alice", "bob"):
            with open(os.path.join(directory, f"{name}.token"), "w") as f:
                f.write(f"{name}-{os.getpid()}\n")
        path = os.path.join(directory, "tenants.toml")
        with open(path, "w") as f:
            f.write('[tenants.alice]\ntoken_file = "alice.token"\nmax_slices = 1\n'
                    'colocated_python = true\n'
                    '[tenants.bob]\ntoken_file = "bob.token"\nmax_slices = 1\n')
        ca = os.path.join(directory, "isthmus-service", "service-cert.pem")
        with LocalServer(fleet=(2, 1, 2), args=["--tenants", path]) as server:
            service = server.address.removeprefix("grpc://")

            def free() -> int:
                return int(server.status()["shared"]["capacity_free"])

            for _ in range(rounds):
                wait_until(lambda: free() == 2, 120, "both slices free")
                client = _ready_client()
                with shared.lease(service, slices=1, token_file=os.path.join(
                        directory, "alice.token"), ca=ca, report=lambda line: None) as grant:
                    results["grant to first program (shared, confined)"].append(
                        _first(client, grant.target))
                ended = time.perf_counter()
                wait_until(lambda: free() == 2, 120, "the renewed slice to be free")
                results["renewal after a colocated tenant's lease"].append(
                    time.perf_counter() - ended)
        with LocalServer(fleet=(2, 1, 2)) as server:
            for _ in range(rounds):
                results["connect to first program (plain fleet)"].append(
                    _first(_ready_client(), server.address))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for kind in ("confined", "plain"):
        key = ("import jax + one op, confined" if kind == "confined"
               else "import jax + one op, not confined")
        for _ in range(rounds):
            out = subprocess.run([sys.executable, "-c", IMPORT, kind], env=env, text=True,
                                 capture_output=True, timeout=120, check=True).stdout
            results[key].append(float(out.strip().splitlines()[-1]))
    print(f"{'what':45s} {'median s':>9s} {'min s':>7s} {'max s':>7s}   (n={rounds})")
    for key, values in results.items():
        print(f"{key:45s} {statistics.median(values):9.3f} {min(values):7.3f} "
              f"{max(values):7.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
