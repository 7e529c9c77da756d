"""A program that crashes a worker process (a real segmentation fault, through the testing
aid ISTHMUS_TEST_CRASH_PROGRAM) fails only its own slice, with DATA_LOSS naming it; the
restarted worker reports it, and the controller refuses it from then on instead of letting it
crash each restarted worker in turn."""

import json
import os

import numpy as np

from isthmus.testing import LocalServer, run_python, run_python_with_pause, slice_pid
from isthmus.worker.crashes import TEST_CRASH_ENV

FLEET = (2, 1, 2)  # 2 slices x 1 host x 2 devices: slice 0 is devices 0, 1; slice 1 is 2, 3

PRELUDE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = {d.id: d for d in jax.devices()}
on = lambda *ids: NamedSharding(Mesh(np.array([devices[i] for i in ids]), ("x",)), P("x"))
slice0, slice1 = on(0, 1), on(2, 3)
x = np.arange(16, dtype=np.float32).reshape(4, 4)

def crash_me(v):
    return v * 3 + 1

def attempt(f, *args):
    try:
        return np.asarray(f(*args)).tolist()
    except Exception as e:  # the error as the user sees it
        return "ERROR " + str(e)
"""

CLIENT = PRELUDE + """
a0, a1 = jax.device_put(x, slice0), jax.device_put(x * 2, slice1)
a0.block_until_ready(), a1.block_until_ready()
crash = jax.jit(crash_me)
out = {"crash": attempt(crash, a0)}
out["a1"] = np.asarray(a1).tolist()
out["on_slice1"] = attempt(jax.jit(lambda v: v.sum(axis=0)), a1)
print("slice 0 crashed", flush=True)
sys.stdin.readline()  # the test waits until slice 0 is back
b0 = jax.device_put(x, slice0)
out["again"] = attempt(crash, b0)  # the executable the client holds: an Execute
out["fine"] = attempt(jax.jit(lambda v: jnp.tanh(v) @ v.T + 1), b0)
print(json.dumps(out), flush=True)
"""

# A client that never ran it: its Compile is refused, on either slice.
FRESH_CLIENT = PRELUDE + """
out = {"slice0": attempt(jax.jit(crash_me), jax.device_put(x, slice0)),
       "slice1": attempt(jax.jit(crash_me), jax.device_put(x, slice1))}
print(json.dumps(out), flush=True)
"""


def test_a_program_that_crashes_a_worker_fails_its_slice_once_and_is_refused_after():
    env = {**os.environ, TEST_CRASH_ENV: "crash_me"}
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    with LocalServer(devices=None, fleet=FLEET, env=env) as server:
        first, other = slice_pid(server.status(), 0), slice_pid(server.status(), 1)
        assert first is not None and other is not None
        restarted = []

        def slice0_back(_line):
            status = server.wait_status(lambda s: slice_pid(s, 0) not in (None, first)
                           and "0" not in s["slices_down"], 90, "slice 0 to come back")
            restarted.append(slice_pid(status, 0))

        result = run_python_with_pause(CLIENT, server.address, slice0_back, timeout=180)
        assert result.returncode == 0, result.stderr[-6000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        # (b) The crash fails the program with DATA_LOSS naming it.
        assert out["crash"].startswith("ERROR") and "DATA_LOSS" in out["crash"], out["crash"]
        assert "jit_crash_me" in out["crash"] and "slice 0" in out["crash"], out["crash"]
        # (c) Slice 1 kept its array and runs programs.
        np.testing.assert_array_equal(out["a1"], x * 2)
        np.testing.assert_array_equal(out["on_slice1"], (x * 2).sum(axis=0))
        # (d) Once slice 0 is back, the program is refused, not run: no second crash.
        again = out["again"]
        assert again.startswith("ERROR") and "FAILED_PRECONDITION" in again, again
        assert "program jit_crash_me crashed worker" in again and "SIGSEGV" not in again
        assert "Segmentation fault" in again and "until its controller restarts" in again
        np.testing.assert_allclose(out["fine"], np.tanh(x) @ x.T + 1, rtol=1e-6)

        fresh = run_python(FRESH_CLIENT, server.address, timeout=120)
        assert fresh.returncode == 0, fresh.stderr[-6000:]
        refused = json.loads(fresh.stdout.strip().splitlines()[-1])
        for where in ("slice0", "slice1"):  # refused on other devices too
            assert "FAILED_PRECONDITION" in refused[where], refused
            assert "program jit_crash_me crashed worker" in refused[where], refused

        status = server.status()
        assert slice_pid(status, 0) == restarted[0], (status, restarted)  # no second restart
        assert slice_pid(status, 1) == other  # slice 1 never went down
        assert not status["slices_down"], status
        log = server.log()
        assert log.count(f"worker {first} ended with signal SIGSEGV") == 1, log
        assert "attempt 1 of 10" in log and "attempt 2 of" not in log, log
        assert log.count("program jit_crash_me crashed worker") == 1, log  # logged once
        assert server.alive()
