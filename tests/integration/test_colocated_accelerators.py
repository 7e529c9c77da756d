"""Colocated CPU devices of an accelerator fleet, through the stock client.

A GPU fleet gives each GPU a CPU device on the same host, for jax's `colocated_python`. This
machine has no GPU, so the servers here run with ISTHMUS_ACCELERATOR_STAND_IN: their CPU
devices are served as accelerators and get colocated CPU devices exactly as GPUs do (the
same controller, worker and client paths; `scripts/gpu-check` runs the same model on CUDA).
Every value is compared with numpy."""

import os
import pathlib
import signal

import pytest

from isthmus.testing import LocalServer, run_python, run_python_with_pause
from isthmus.worker.platforms import STAND_IN_ENV, STAND_IN_KIND

BASE = 1 << 20
STAND_IN = {**os.environ, STAND_IN_ENV: "1"}
SHAPES = {"embedded": {"devices": 4}, "fleet": {"devices": None, "fleet": (2, 1, 2)}}
EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module", params=list(SHAPES))
def accelerators(request):
    with LocalServer(env=STAND_IN, **SHAPES[request.param]) as s:
        s.kind = request.param
        yield s
        assert s.alive(), f"the server died during the tests:\n{s.log()}"


MODEL = f"""
import os
import jax, numpy as np
from jax.experimental import colocated_python as cp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
assert [d.id for d in devices] == [0, 1, 2, 3], devices
assert {{d.device_kind for d in devices}} == {{{STAND_IN_KIND!r}}}
assert jax.local_devices() == devices  # the CPU devices are not among them
every = devices[0].client._get_all_devices()
cpu = cp.colocated_cpu_devices(devices)
assert [d.id for d in cpu] == [{BASE} + i for i in range(4)], cpu
assert sorted(d.id for d in every) == [0, 1, 2, 3] + [d.id for d in cpu]
assert [d.colocation_id for d in cpu] == [d.colocation_id for d in devices]
assert {{d.device_kind for d in cpu}} == {{"cpu"}}
assert list(cp.colocated_cpu_devices(cpu)) == list(cpu)  # CPU devices map to themselves
rows = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
cpu_rows = NamedSharding(Mesh(np.array(cpu), ("x",)), P("x"))
data = np.arange(32.0).reshape(8, 4)

@cp.colocated_python
def where(x):
    shards = []
    for s in x.addressable_shards:
        assert np.array_equal(np.asarray(s.data), np.arange(32.0).reshape(8, 4)[s.index] + 1)
        value = np.asarray(s.data) * 2
        value[:, 0] = os.getpid()
        shards.append(jax.device_put(value, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

# Accelerator -> its colocated CPU device -> a call there -> back to the accelerator.
on_accelerators = jax.jit(lambda a: a + 1, out_shardings=rows)(jax.device_put(data, rows))
out = where(jax.device_put(on_accelerators, cpu_rows))
assert out.sharding.device_set == set(cpu)
host = np.asarray(out)
np.testing.assert_array_equal(host[:, 1:], (data[:, 1:] + 1) * 2)
print("PIDS", [int(p) for p in host[::2, 0]])  # one per device (2 rows each)
back = jax.device_put(out, rows)
assert back.sharding.device_set == set(devices)
np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 0.5)(back)), host * 0.5)
# Programs run on the colocated CPU devices too, over several hosts.
total = jax.jit(lambda a: a.sum())(jax.device_put(data, cpu_rows))
assert float(total) == data.sum(), float(total)
# Colocated Python on an accelerator is refused with the way out.
try:
    where(jax.device_put(data, rows))
except Exception as e:
    assert "INVALID_ARGUMENT" in str(e) and "colocated_cpu_devices" in str(e), str(e)
else:
    raise AssertionError("a colocated call on accelerators was not refused")
print("OK")
"""


def test_each_accelerator_has_a_colocated_cpu_device_on_its_host(accelerators):
    result = run_python(MODEL, accelerators.address, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "OK" in result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("PIDS"))
    pids = [int(p) for p in line.split(None, 1)[1].strip("[]").split(",")]
    if accelerators.kind == "embedded":
        assert set(pids) == {accelerators.process.pid}, pids
    else:  # devices 0, 1 on slice 0's worker, 2, 3 on slice 1's
        expected = [accelerators.worker_pids(s)[0] for s in (0, 0, 1, 1)]
        assert pids == expected, (pids, expected)


@pytest.mark.parametrize("example", ["colocated_data_loader.py",
                                     "colocated_checkpoint_writer.py"])
def test_the_colocated_examples_use_the_accelerators(accelerators, example, tmp_path):
    code = (EXAMPLES / example).read_text()
    result = run_python(code, accelerators.address, timeout=240, args=[str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "the same losses either way" in result.stdout or (
        "equal to the saved array" in result.stdout), result.stdout


LOSS = MODEL.split("data = ")[0] + """
import sys
data = np.arange(8.0)
lost_cpu = jax.device_put(data, cpu[0])       # slice 0
kept_cpu = jax.device_put(data * 3, cpu[2])   # slice 1
kept = jax.device_put(data + 1, devices[3])   # slice 1
jax.block_until_ready((lost_cpu, kept_cpu, kept))  # not fetched: jax would keep the values
print("READY", flush=True)
sys.stdin.readline()  # the test kills slice 0's worker now

@cp.colocated_python
def double(x):
    return jax.device_put(np.asarray(x) * 2, x.sharding)

try:
    np.asarray(lost_cpu)
except Exception as e:
    print("LOST", str(e).split(":")[0])
np.testing.assert_array_equal(np.asarray(kept_cpu), data * 3)
np.testing.assert_array_equal(np.asarray(double(kept_cpu)), data * 6)
np.testing.assert_array_equal(np.asarray(jax.device_put(kept_cpu, devices[3]) + kept),
                              data * 4 + 1)
print("OK")
"""


def test_a_lost_host_takes_its_colocated_cpu_devices_only():
    with LocalServer(env=STAND_IN, devices=None, fleet=(2, 1, 2)) as server:
        result = run_python_with_pause(
            LOSS, server.address, lambda line: server.kill_worker(0, sig=signal.SIGKILL))
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert result.stdout.startswith("READY"), result.stdout
        assert "LOST DATA_LOSS" in result.stdout, result.stdout
        assert "OK" in result.stdout
        assert server.alive(), server.log()
