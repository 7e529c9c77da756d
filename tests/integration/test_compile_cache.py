"""`--compile-cache`: a program compiled before a restart is loaded, not compiled, after it,
on the embedded backend and on a fleet (a program over two worker processes), with results
equal to numpy; bad options are one line and exit code 2."""

import subprocess
import sys

import pytest

from isthmus.testing import LocalServer, run_python, wait_until

CLIENT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
x = np.arange(64, dtype=np.float32).reshape(len(jax.devices()) * 4, -1)
step = jax.jit(lambda v: jnp.tanh(v * 0.01).sum(0) + v.mean(),
               out_shardings=NamedSharding(mesh, P()))
out = np.asarray(step(jax.device_put(x, NamedSharding(mesh, P("x")))))
np.testing.assert_allclose(out, np.tanh(x * 0.01).sum(0) + x.mean(), rtol=1e-5)
print("OK")
"""


def hits(server):
    workers = server.status()["workers"]
    return {w: v.get("compile_cache_hits", 0) for w, v in workers.items()}


@pytest.mark.parametrize("shape", [{"devices": 2}, {"devices": None, "fleet": (1, 2, 1)}],
                         ids=["embedded", "fleet"])
def test_programs_survive_a_restart(shape, tmp_path):
    args = ["--compile-cache", str(tmp_path)]
    with LocalServer(**shape, args=args) as server:
        result = run_python(CLIENT, server.address, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert set(hits(server).values()) == {0}
    stored = sorted(p.name for p in (tmp_path / "default").iterdir())
    assert stored and all(name.endswith(".xla") for name in stored)
    with LocalServer(**shape, args=args) as server:
        result = run_python(CLIENT, server.address, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        # Workers report their figures with heartbeats; every host loaded the program.
        wait_until(lambda: (found := hits(server)) and all(v >= 1 for v in found.values()),
                   20, "every host to report a compile cache hit",
                   explain=lambda: f"hits: {hits(server)}")
        assert server.alive(), server.log()
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == stored


@pytest.mark.parametrize("option, message", [
    (["--compile-cache-size", "0"], "--compile-cache-size must be positive"),
    (["--compile-cache-namespace", "a/b"], "--compile-cache-namespace must be a plain name"),
    (["--compile-cache", "/proc/isthmus-cache"], "give a directory this user can write"),
])
def test_bad_cache_options_are_refused(option, message, tmp_path):
    if option[0] != "--compile-cache":
        option = ["--compile-cache", str(tmp_path), *option]
    result = subprocess.run([sys.executable, "-m", "isthmus.cli", "up", "--devices", "1",
                             "--port", "0", *option], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
