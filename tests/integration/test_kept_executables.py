"""Executables are compiled once: a new program's workers load the vetting process's trial
compile. They outlive a collective group and a worker process: when a slice is lost and
comes back, the surviving worker loads the program it had for the same members before (kept
in its memory), and the restarted worker loads what the worker before it in its slot had
(the local fleet's own compilation cache). Each time they compute what numpy does."""

import numpy as np

from isthmus.testing import LocalServer, run_python, slice_pid, wait_until
from tests.integration.scraping import metrics_url, scrape_when, value

CLIENT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))
step = jax.jit(lambda a: jnp.tanh(a) * 3.0 + a.sum(), out_shardings=NamedSharding(mesh, P()))
print("RESULT", *np.asarray(step(x)).tolist())
"""


def _run(server):
    result = run_python(CLIENT, server.address, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:] + "\n" + server.log()
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_allclose([float(v) for v in line.split()[1:]],
                               np.tanh(x) * 3.0 + x.sum(), rtol=1e-6)


def test_a_returning_slice_loads_what_was_compiled_before():
    with LocalServer(devices=None, fleet=(2, 1, 1), args=["--metrics-port", "0"]) as server:
        base = metrics_url(server)
        _run(server)
        # Neither worker had it (the fleet's cache is new), and neither compiled it: both
        # loaded the vetting process's trial compile. Workers report with their heartbeats,
        # and a report may be taken mid-compile (the miss counted, the load not yet): wait
        # for both workers' loads, whatever they were.
        found = scrape_when(base, lambda f: value(f["isthmus_persistent_cache_misses"]) >= 2
                            and value(f["isthmus_worker_programs_vetted"])
                            + value(f["isthmus_worker_programs_compiled"]) >= 2,
                            "two loads reported")
        assert value(found["isthmus_persistent_cache_misses"]) == 2
        assert value(found["isthmus_worker_programs_vetted"]) == 2
        assert value(found["isthmus_worker_programs_compiled"]) == 0
        assert value(found["isthmus_kept_executable_hits"]) == 0

        victim = slice_pid(server.status(), 1)
        server.kill_worker(1)
        wait_until(lambda: (lambda s: "1" not in s["slices_down"] and slice_pid(s, 1) not in
                            (None, victim))(server.status()), 60,
                   "the launcher to bring slice 1 back", explain=server.log)
        _run(server)  # a new client: jax compiles it again, the workers load it

        found = scrape_when(base, lambda f: value(f["isthmus_kept_executable_hits"]) >= 1
                            and value(f["isthmus_persistent_cache_hits"]) >= 1,
                            "the workers' loads reported")
        # Slice 0 loaded its group-1 executable from memory; slice 1's new worker loaded its
        # predecessor's from the fleet's cache; neither compiled nor took the vetted one.
        assert value(found["isthmus_kept_executable_hits"]) == 1
        assert value(found["isthmus_persistent_cache_hits"]) == 1
        assert value(found["isthmus_persistent_cache_misses"]) == 1  # slice 0's first load
        assert value(found["isthmus_worker_programs_vetted"]) == 1  # slice 0's, then
        assert value(found["isthmus_worker_programs_compiled"]) == 0
        assert server.alive(), server.log()
