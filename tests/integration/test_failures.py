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

READS = """
def reads(y):
    for reader, read in [("fetch", lambda: np.asarray(y)),
                         ("later program", lambda: np.asarray(jax.jit(lambda v: v + 1)(y))),
                         ("wait", lambda: y.block_until_ready())]:
        try:
            read()
            print("READ-OK", reader)
        except Exception as e:
            print("READ-FAILED", reader, "::", str(e).replace(chr(10), " ")[:800])
"""

ONE_HOST = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
""" + READS + """
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
x = jax.device_put(np.arange(16, dtype=np.float32), s)
one = jax.device_put(np.arange(4, dtype=np.float32), jax.devices()[0])
def doomed_local(v):
    return v * 2 + jnp.sum(v)
reads(jax.jit(doomed_local)(one))     # a program on one host's device
print("X", np.asarray(jax.jit(lambda v: v * 3)(x)).tolist())
"""

SPANNING = """
import time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
""" + READS + """
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
x = jax.device_put(np.arange(16, dtype=np.float32), s)
def doomed_step(v):
    return v * 2 + jnp.sum(v)
reads(jax.jit(doomed_step)(x))        # a program over both hosts
# The slice comes back (the worker rejoins): new arrays work again.
deadline = time.monotonic() + 60
while True:
    try:
        fresh = jax.device_put(np.arange(16, dtype=np.float32), s)
        print("AGAIN", np.asarray(jax.jit(lambda v: v * 3)(fresh)).tolist())
        break
    except Exception as e:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"""


@pytest.fixture(scope="module")
def faulty_fleet():
    env = dict(os.environ, ISTHMUS_TEST_RAISE_PROGRAM="doomed")
    with LocalServer(devices=None, fleet=(1, 2, 2), env=env) as server:
        yield server


def _failed_reads(stdout):
    failed = [line for line in stdout.splitlines() if line.startswith("READ-FAILED")]
    assert len(failed) == 3, stdout  # every reader of the output hears the cause, none waits
    return failed


def test_a_command_the_worker_cannot_apply_fails_its_readers_and_is_logged(faulty_fleet):
    result = run_python(ONE_HOST, faulty_fleet.address, timeout=90)
    assert result.returncode == 0, result.stderr[-4000:]
    for line in _failed_reads(result.stdout):
        assert "INTERNAL" in line and "raising on purpose" in line, line
        assert "bug in isthmus" in line and "worker-s0-h" in line, line  # its log
    # The array it did not touch is still valid.
    assert f"X {[3.0 * i for i in range(16)]}" in result.stdout.splitlines(), result.stdout
    # The worker's traceback is in the controller's log at the default level, with the
    # worker's name and its log file.
    log = faulty_fleet.log()
    assert "RuntimeError: raising on purpose" in log, log[-4000:]
    assert "Traceback (most recent call last)" in log
    named = re.search(r"worker \S+ \(slice 0, host \d\) \(isthmus\.worker\.\w+; its log: "
                      r"(\S+worker-s0-h\d\.log)\)", log)
    assert named, log[-4000:]
    assert os.path.exists(named.group(1))
    assert faulty_fleet.alive()


def test_a_refused_part_of_a_program_over_several_hosts_fails_its_slice(faulty_fleet):
    """The other hosts' parts of such a program would wait for the refused one in their
    collectives forever: the worker leaves the fleet, the group re-forms (which ends their
    wait), readers get DATA_LOSS naming the cause, and the slice comes back."""
    result = run_python(SPANNING, faulty_fleet.address, timeout=150)
    assert result.returncode == 0, result.stderr[-4000:]
    for line in _failed_reads(result.stdout):
        assert "DATA_LOSS" in line or "raising on purpose" in line, line
    assert any("raising on purpose" in line for line in _failed_reads(result.stdout))
    assert f"AGAIN {[3.0 * i for i in range(16)]}" in result.stdout.splitlines(), result.stdout
    log = faulty_fleet.log()
    assert "left the fleet" in log and "the other parts would wait for it forever" in log
    assert faulty_fleet.alive()
