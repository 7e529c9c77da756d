"""jax.experimental.colocated_python through isthmus: the stock client's calls run in the
processes that hold the shards (the workers of a fleet, the server of the embedded backend),
on those processes' own shards, and every result is compared with numpy."""

import os
import pathlib
import signal

import pytest

from isthmus.testing import LocalServer, run_python, run_python_with_pause, wait_until

PRELUDE = """
import os, threading, time
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import colocated_python as cp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
cpu = cp.colocated_cpu_devices(jax.devices())
assert [d.id for d in cpu] == [d.id for d in jax.devices()], cpu
mesh = Mesh(np.array(cpu), ("x",))
rows = NamedSharding(mesh, P("x"))
"""

WHERE = PRELUDE + """
x = jax.device_put(np.arange(32.0).reshape(16, 2), rows)

@cp.colocated_python
def where(x):
    # Each process sees the global array; its addressable shards are its own, with their
    # global indices.
    assert x.shape == (16, 2), x.shape
    shards = []
    for s in x.addressable_shards:
        assert np.array_equal(np.asarray(s.data), np.arange(32.0).reshape(16, 2)[s.index])
        value = np.asarray(s.data) * 2 + 1
        value[:, 1] = os.getpid()
        shards.append(jax.device_put(value, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

out = np.asarray(where(x))
np.testing.assert_array_equal(out[:, 0], np.arange(0.0, 32.0, 2) * 2 + 1)
pids = [int(p) for p in out[::2, 1]]  # one per device (2 rows each)
assert os.getpid() not in pids
print("PIDS", pids)
# Later calls run asynchronously on the discovered specs.
again = [where(x) for _ in range(3)]
for y in again:
    np.testing.assert_array_equal(np.asarray(y), out)
print("OK")
"""


def _pids(stdout):
    line = next(line for line in stdout.splitlines() if line.startswith("PIDS"))
    return [int(p) for p in line.split(None, 1)[1].strip("[]").split(",")]


def test_calls_run_where_the_shards_are(server):
    result = run_python(WHERE, server.address, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "OK" in result.stdout
    pids = _pids(result.stdout)
    if server.kind == "embedded":
        assert set(pids) == {server.process.pid}, pids  # the embedded host is the server
    else:
        # 4 worker processes with 2 devices each; none is the client or the server.
        assert len(set(pids)) == 4 and server.process.pid not in pids, pids
        assert all(pids[i] == pids[i + 1] for i in range(0, 8, 2)), pids


STATE = PRELUDE + """
@cp.colocated_python_class
class Counter:
    def __init__(self, start):
        self.total = np.float32(start)
        self.pid = os.getpid()

    def add(self, x):
        self.total += np.asarray(x).sum()
        return jax.device_put(np.full(x.shape, self.total, np.float32), x.sharding)

counter = Counter(10)
x = jax.device_put(np.ones(3, np.float32), cpu[-1])
values = [float(np.asarray(counter.add(x))[0]) for _ in range(4)]
assert values == [13.0, 16.0, 19.0, 22.0], values

# No inputs: specialized with devices; specs given by out_specs_fn (asynchronous calls).
one = jax.sharding.SingleDeviceSharding(cpu[1])  # jax pickles shardings, not devices

@cp.colocated_python
def make():
    return jax.device_put(np.arange(4, dtype=np.int32), one)

make = make.specialize(devices=cpu[1:2])
np.testing.assert_array_equal(np.asarray(make()), np.arange(4))

@cp.colocated_python
def scale(x):
    return jax.device_put(np.asarray(x) * 3, x.sharding)

scale = scale.specialize(out_specs_fn=lambda x: x)
y = jax.device_put(np.arange(6.0), cpu[2])
outs = [scale(y) for _ in range(5)]
for out in outs:
    np.testing.assert_array_equal(np.asarray(out), np.arange(6.0) * 3)

# Strings travel both ways (the specs themselves do on every first call).
@cp.colocated_python
def shout(x):
    return jax.device_put(np.char.upper(np.asarray(x)), x.sharding)

words = jax.device_put(np.array(["ab", "cd"], dtype=np.dtypes.StringDType()), cpu[0])
print("SHOUT", list(np.asarray(shout(words))))
print("OK")
"""


def test_classes_keep_state_and_specializations_work(server):
    result = run_python(STATE, server.address, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "SHOUT ['AB', 'CD']" in result.stdout, result.stdout
    assert "OK" in result.stdout


ORDER = PRELUDE + """
x = jax.device_put(np.array(1), cpu[0])

@cp.colocated_python
def setup(x):
    cp._test_log = []
    cp._test_barrier = threading.Barrier(3)
    return x

@cp.colocated_python
def log(x):
    cp._test_log.append(int(np.asarray(x)))
    return x

@cp.colocated_python
def meet(x):
    cp._test_barrier.wait(timeout=20)  # only if three calls run at once
    return x

@cp.colocated_python
def read(x):
    return jax.device_put(np.array(cp._test_log), x.sharding)

jax.block_until_ready(setup(x))
log = log.specialize(out_specs_fn=lambda x: x)
# One thread: calls run one after another, in program order.
for i in range(20):
    log(jax.device_put(np.array(i), cpu[0]))
np.testing.assert_array_equal(np.asarray(read(x)), np.arange(20))
# Three threads: their calls run concurrently (they meet at a barrier).
meet = meet.specialize(out_specs_fn=lambda x: x)
threads = [threading.Thread(target=lambda: jax.block_until_ready(meet(x))) for _ in range(3)]
[t.start() for t in threads]
[t.join(60) for t in threads]
assert not any(t.is_alive() for t in threads)
print("OK")
"""


def test_calls_keep_program_order_per_thread_and_run_concurrently_across(server):
    result = run_python(ORDER, server.address, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "OK" in result.stdout


ERRORS = PRELUDE + """
class Oops(Exception):
    pass

x = jax.device_put(np.arange(4.0), cpu[0])
kept = jax.device_put(np.arange(8.0), rows)

@cp.colocated_python
def fails(x):
    raise Oops("the loader ran out of files")

for attempt in range(2):
    try:
        np.asarray(fails(x))
    except Exception as e:
        text = str(e)
        assert "Oops: the loader ran out of files" in text, text
        assert "Traceback" in text and "in fails" in text, text
        print("CODE", text.split(":")[0])
    else:
        raise AssertionError("no error")

# An asynchronous call that fails: the error arrives with the output.
@cp.colocated_python
def maybe(x):
    if float(np.asarray(x)[0]) > 0:
        raise ValueError("positive input")
    return x

maybe = maybe.specialize(out_specs_fn=lambda x: x)
bad = maybe(jax.device_put(np.ones(4), cpu[0]))
try:
    jax.block_until_ready(bad)
except Exception as e:
    assert "ValueError: positive input" in str(e), str(e)
else:
    raise AssertionError("no error")
np.testing.assert_array_equal(np.asarray(maybe(jax.device_put(np.zeros(4), cpu[0]))),
                              np.zeros(4))
# Nothing else was lost.
np.testing.assert_array_equal(np.asarray(kept), np.arange(8.0))
np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v * 2)(kept)), np.arange(8.0) * 2)
print("OK")
"""


def test_user_exceptions_reach_the_client_and_nothing_is_lost(server):
    result = run_python(ERRORS, server.address, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "CODE UNKNOWN" in result.stdout, result.stdout
    assert "OK" in result.stdout
    assert server.alive(), server.log()


DEATH = PRELUDE + """
import sys
x = jax.device_put(np.arange(4.0), cpu[0])
other = jax.device_put(np.arange(4.0), cpu[-1])

@cp.colocated_python
def pid(x):
    return jax.device_put(np.full(x.shape, os.getpid(), np.float64), x.sharding)

@cp.colocated_python
def slow(x):
    time.sleep(30)  # still running when the test kills its worker
    return x

worker = int(np.asarray(pid(x))[0])
slow = slow.specialize(out_specs_fn=lambda x: x)
pending = slow(x)  # compiled and running
print("WORKER", worker, flush=True)
sys.stdin.readline()  # the test kills the worker now
try:
    jax.block_until_ready(pending)
except Exception as e:
    print("LOST", str(e).split(":")[0], "slice 0" in str(e))
# The other slice still answers.
np.testing.assert_array_equal(np.asarray(pid(other)) > 0, np.ones(4, bool))
print("OK")
"""


def test_a_worker_lost_during_a_call_fails_it_with_data_loss():
    with LocalServer(devices=None, fleet=(2, 1, 2)) as server:
        result = run_python_with_pause(
            DEATH, server.address, lambda line: os.kill(int(line.split()[1]), signal.SIGKILL))
        assert result.stdout.startswith("WORKER"), result.stdout + result.stderr[-3000:]
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert "LOST DATA_LOSS True" in result.stdout, result.stdout
        assert "OK" in result.stdout
        assert server.alive(), server.log()


KEPT = PRELUDE + """
import sys
x = jax.device_put(np.arange(4.0), cpu[-1])  # on slice 1, which survives

@cp.colocated_python
def keep(x):
    cp._test_kept = x * 2  # an array of the collective group's client, kept in the process
    return x

@cp.colocated_python
def give(x):
    return cp._test_kept

jax.block_until_ready(keep(x))
print("KEPT", flush=True)
sys.stdin.readline()  # the test kills slice 0's worker and waits for the group to re-form
np.testing.assert_array_equal(np.asarray(give(x)), np.arange(4.0) * 2)
print("OK")
"""


ACROSS = PRELUDE + """
import sys
x = jax.device_put(np.arange(4.0), cpu[0])  # on slice 0, which survives

@cp.colocated_python
def slow_double(x):
    if np.asarray(x)[1] == 1:  # x itself, not the warm-up's zeros nor the doubled x
        time.sleep(3)
    return jax.device_put(np.asarray(x) * 2, x.sharding)

slow_double = slow_double.specialize(out_specs_fn=lambda x: x)
jax.block_until_ready(slow_double(jax.device_put(np.zeros(4), cpu[0])))  # loaded
pending = slow_double(x)  # sleeps while slice 1 is lost and the group re-forms
print("CALLED", flush=True)
sys.stdin.readline()
np.testing.assert_array_equal(np.asarray(pending), np.arange(4.0) * 2)
np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 1)(pending)),
                              np.arange(4.0) * 2 + 1)
np.testing.assert_array_equal(np.asarray(slow_double(pending)), np.arange(4.0) * 4)
print("OK")
"""


@pytest.mark.parametrize("script, victim", [(KEPT, 0), (ACROSS, 1)], ids=["kept", "running"])
def test_colocated_python_on_a_surviving_slice_outlives_a_re_formation(script, victim):
    # The surviving worker's client is replaced when the group re-forms without the other
    # slice. An array its Python kept from the old client (a colocated object's state, or
    # jax's result store between the call that finds a function's output specs and the one
    # that pops its result) is still returned, onto the new client's device; a call still
    # running keeps its outputs, which land in the new client.
    with LocalServer(devices=None, fleet=(2, 1, 2)) as server:
        def kill_and_wait(line):
            generation = server.status()["generation"]
            server.kill_worker(victim)
            wait_until(lambda: server.status()["generation"] > generation, 30,
                       f"the group to re-form without slice {victim}", explain=server.log)

        result = run_python_with_pause(script, server.address, kill_and_wait)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert "OK" in result.stdout
        assert server.alive(), server.log()


EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


def test_data_loader_example(server):
    code = (EXAMPLES / "colocated_data_loader.py").read_text()
    result = run_python(code, server.address, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "the same losses either way" in result.stdout, result.stdout


def test_checkpoint_writer_example(server, tmp_path):
    code = (EXAMPLES / "colocated_checkpoint_writer.py").read_text()
    result = run_python(code, server.address, timeout=240, args=[str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equal to the saved array" in result.stdout, result.stdout
    expected = "by 1 process(es)" if server.kind == "embedded" else "by 4 process(es)"
    assert f"{expected}; by this one: False" in result.stdout, result.stdout
    assert len(list(tmp_path.glob("shard-*.npy"))) == 8
