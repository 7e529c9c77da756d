"""Self-healing local fleets: a launched worker that dies is started again (and stays dead
with --no-restart)."""

import json
import os
import signal
import time

import numpy as np

from isthmus.testing import LocalServer, run_python, slice_pid

FLEET = (2, 1, 2)  # 2 slices x 1 host x 2 devices: slice 1 is devices 2 and 3



PROGRAM = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = [d for d in jax.devices() if d.id in (2, 3)]
x = jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4),
                   NamedSharding(Mesh(np.array(devices), ("x",)), P("x")))
y = jax.jit(lambda v: jnp.tanh(v) @ v.T + 1)(x)
print(json.dumps({"y": np.asarray(y).tolist(), "devices": sorted(d.id for d in y.devices())}))
"""


def test_a_killed_worker_is_restarted_and_its_slice_works_again():
    with LocalServer(devices=None, fleet=FLEET) as server:
        before = slice_pid(server.status(), 1)
        assert before is not None
        os.kill(before, signal.SIGKILL)
        server.wait_status(lambda s: slice_pid(s, 1) not in (None, before)
              and "1" not in s["slices_down"], 60, "slice 1 to come back")
        result = run_python(PROGRAM, server.address, timeout=60)
        assert result.returncode == 0, result.stderr[-5000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        x = np.arange(16, dtype=np.float32).reshape(4, 4)
        np.testing.assert_allclose(out["y"], np.tanh(x) @ x.T + 1, rtol=1e-6)
        assert out["devices"] == [2, 3]
        log = server.log()
        assert f"worker {before} ended with signal SIGKILL" in log, log
        assert "(slice 1, host 0)" in log and "attempt 1 of 10" in log, log
        assert server.alive()


def test_with_no_restart_a_killed_worker_stays_dead():
    with LocalServer(devices=None, fleet=FLEET, args=["--no-restart"]) as server:
        before = slice_pid(server.status(), 1)
        assert before is not None
        os.kill(before, signal.SIGKILL)
        server.wait_status(lambda s: "1" in s["slices_down"], 30, "slice 1 to be marked down")
        deadline = time.monotonic() + 3.0  # time enough for several restarts, were they on
        while time.monotonic() < deadline:
            status = server.status()
            assert "1" in status["slices_down"] and slice_pid(status, 1) is None, status
            time.sleep(0.2)
        assert slice_pid(status, 0) is not None and "0" not in status["slices_down"]
        assert "restarting it" not in server.log()
        assert server.alive()
