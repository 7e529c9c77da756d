"""`--compile-cache`: a program compiled before a restart is loaded, not compiled, after it,
on the embedded backend and on a fleet (a program over two worker processes), with results
equal to numpy; bad options are one line and exit code 2."""

import os
import subprocess
import sys

import pytest

from isthmus.serve import child_environment
from isthmus.testing import LocalServer, run_isthmus, run_python, wait_until

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


def vetting(server):
    return server.status()["vetting"]


def run_file(path, address):
    """The client script at a fixed path: the same bytes in every run (jax's programs carry
    their source locations)."""
    result = subprocess.run([sys.executable, str(path)], env=child_environment(
        address, dict(os.environ)), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


@pytest.mark.parametrize("shape", [{"devices": 2}, {"devices": None, "fleet": (1, 2, 1)}],
                         ids=["embedded", "fleet"])
def test_programs_survive_a_restart(shape, tmp_path):
    args = ["--compile-cache", str(tmp_path / "cache")]
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    with LocalServer(**shape, args=args) as server:
        run_file(script, server.address)
        assert set(hits(server).values()) == {0}
        # The program (and the client's own small programs) were compiled on trial once.
        assert vetting(server)["trial_compiles"] >= 1 and vetting(server)["record_hits"] == 0
    stored = sorted(p.name for p in (tmp_path / "cache" / "default").iterdir())
    assert stored and all(name.endswith(".xla") for name in stored)
    with LocalServer(**shape, args=args) as server:
        run_file(script, server.address)
        # Workers report their figures with heartbeats; every host loaded the program.
        wait_until(lambda: (found := hits(server)) and all(v >= 1 for v in found.values()),
                   20, "every host to report a compile cache hit",
                   explain=lambda: f"hits: {hits(server)}")
        # The same bytes were found vetted: no trial compile before the hosts' hits.
        assert vetting(server)["trial_compiles"] == 0, vetting(server)
        assert vetting(server)["record_hits"] >= 1, vetting(server)
        assert vetting(server)["trials_skipped"] == 0, vetting(server)
        # The same program from an edited script (other source lines: other bytes, the same
        # canonical program) is parsed again, but not compiled on trial again.
        edited = "\n\n\n# an edit above the step moves its source lines\n" + CLIENT
        result = run_python(edited, server.address, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert vetting(server)["trial_compiles"] == 0, vetting(server)
        assert vetting(server)["trials_skipped"] >= 1, vetting(server)
        assert server.alive(), server.log()
    assert sorted(p.name for p in (tmp_path / "cache" / "default").iterdir()) == stored


@pytest.mark.parametrize("option, message", [
    (["--compile-cache-size", "0"], "--compile-cache-size must be positive"),
    (["--compile-cache-namespace", "a/b"], "--compile-cache-namespace must be a plain name"),
    (["--compile-cache", "/proc/isthmus-cache"], "give a directory this user can write"),
])
def test_bad_cache_options_are_refused(option, message, tmp_path):
    if option[0] != "--compile-cache":
        option = ["--compile-cache", str(tmp_path), *option]
    result = run_isthmus(["up", "--devices", "1", "--port", "0", *option], timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
