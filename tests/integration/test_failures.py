"""No failure leaves a client waiting (issue 36): a worker that cannot apply a command fails
its outputs with the cause, every later reader gets that error, arrays it did not touch stay
valid, and the worker's traceback reaches the controller's log with the worker's log path.

The worker raises through the testing aid `ISTHMUS_TEST_RAISE_PROGRAM` (worker/crashes.py)
where the bug of issue 36 raised: after the program is loaded, before the Execute is applied,
outside the command itself. Before the fix such an exception ended the worker's command loop
silently and the client waited forever."""

import os
import re

import pytest

from isthmus.testing import LocalServer, run_python

CLIENT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
x = jax.device_put(np.arange(16, dtype=np.float32), s)
def doomed_step(x):
    return x * 2 + jnp.sum(x)
y = jax.jit(doomed_step)(x)
for reader, read in [("fetch", lambda: np.asarray(y)),
                     ("later program", lambda: np.asarray(jax.jit(lambda v: v + 1)(y))),
                     ("wait", lambda: y.block_until_ready())]:
    try:
        read()
        print("READ-OK", reader)
    except Exception as e:
        print("READ-FAILED", reader, "::", str(e).replace(chr(10), " ")[:600])
print("X", np.asarray(jax.jit(lambda v: v * 3)(x)).tolist())
"""


@pytest.fixture(scope="module")
def faulty_fleet():
    env = dict(os.environ, ISTHMUS_TEST_RAISE_PROGRAM="doomed_step")
    with LocalServer(devices=None, fleet=(1, 2, 2), env=env) as server:
        yield server


def test_a_command_the_worker_cannot_apply_fails_its_readers_and_is_logged(faulty_fleet):
    result = run_python(CLIENT, faulty_fleet.address, timeout=90)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    failed = [line for line in lines if line.startswith("READ-FAILED")]
    # Every reader of the output hears the cause, none waits.
    assert len(failed) == 3, result.stdout
    for line in failed:
        assert "raising on purpose" in line and "bug in isthmus" in line, line
    # The array it did not touch is still valid.
    assert f"X {[3.0 * i for i in range(16)]}" in lines, result.stdout
    # The worker's traceback is in the controller's log at the default level, with the
    # worker's name and its log file.
    log = faulty_fleet.log()
    assert "RuntimeError: raising on purpose" in log, log[-4000:]
    assert "Traceback (most recent call last)" in log
    named = re.search(r"worker \S+ \(slice 0, host \d\) \(isthmus\.worker\.agent; its log: "
                      r"(\S+worker-s0-h\d\.log)\)", log)
    assert named, log[-4000:]
    assert os.path.exists(named.group(1))
    assert faulty_fleet.alive()
