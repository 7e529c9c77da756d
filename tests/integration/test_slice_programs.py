"""Programs one controller drives over several slices at once (issue 27): examples/rl_loop.py
(a learner on slice 0 and a sampler on slice 1 in two threads, weights copied slice to slice
every round) and examples/batch_inference.py (a model sharded over a slice serving a stream
of batches), each run unmodified with the stock client on a fleet of 2 slices and on local
jax, and compared."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from isthmus.serve import child_environment
from isthmus.testing import LocalServer
from tests.integration.harness import run_snippet

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLEET = (2, 1, 2)  # 2 slices x 1 host x 2 devices
SMALL = {"RL_ROUNDS": "4", "RL_STEPS": "4", "INFER_BATCHES": "12"}


def _run(script, env, where):
    env = {**env, **SMALL}
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{script} failed {where}:\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _remote(script, server):
    env = child_environment(server.address)
    env.pop("XLA_FLAGS", None)  # the test process's local device count, not the client's
    return _run(script, env, "through isthmus")


def _local(script):
    env = {k: v for k, v in os.environ.items() if k != "JAX_BACKEND_TARGET"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    return _run(script, env, "on local jax")


@pytest.fixture(scope="module")
def fleet():
    # Each slice on CPUs of its own, as on separate hardware (bench/slices.py runs so too).
    with LocalServer(devices=None, fleet=FLEET, args=["--pin-slices"]) as server:
        yield server


def test_pinned_slices_run_on_cpus_of_their_own(fleet):
    """`--pin-slices`: every thread of a slice's worker runs on that slice's share only."""
    shares = []
    for worker in fleet.status()["fleet"].values():
        pid = worker["pid"]
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 4  # XLA's and gRPC's threads, not only the main one
        share = {frozenset(os.sched_getaffinity(int(t))) for t in threads}
        assert len(share) == 1, f"worker {pid}'s threads run on different CPUs: {share}"
        shares.append(share.pop())
    everything = os.sched_getaffinity(0)
    assert all(s <= everything for s in shares)
    if len(everything) >= len(shares):
        assert not set.intersection(*map(set, shares)), shares


def test_a_learner_and_a_sampler_on_two_slices_match_local_jax(fleet):
    remote, local = _remote("rl_loop.py", fleet), _local("rl_loop.py")
    assert remote["slices"] == [[0], [1]]  # the learner on slice 0, the sampler on slice 1
    assert len(remote["losses"]) == int(SMALL["RL_ROUNDS"])
    np.testing.assert_allclose(remote["losses"], local["losses"], rtol=1e-5)
    np.testing.assert_allclose(remote["checksum"], local["checksum"], rtol=1e-5)
    assert remote["losses"][-1] < remote["losses"][0]  # it learns


def test_a_model_sharded_over_a_slice_serves_a_stream_like_local_jax(fleet):
    remote, local = _remote("batch_inference.py", fleet), _local("batch_inference.py")
    assert remote["batches"] == local["batches"] == int(SMALL["INFER_BATCHES"])
    assert remote["devices"] == local["devices"] == 2
    np.testing.assert_allclose(remote["first_row"], local["first_row"], rtol=1e-5)
    np.testing.assert_allclose(remote["checksum"], local["checksum"], rtol=1e-6)


COPY_ACROSS = """
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
first = [d for d in devices if d.slice_index == 0]
second = [d for d in devices if d.slice_index == 1]
x = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
a = jax.device_put(x, NamedSharding(Mesh(np.array(first), ("d",)), P()))
rows = jax.device_put(x, NamedSharding(Mesh(np.array(first), ("d",)), P("d")))
# 4 MiB: between workers of one machine, through a file of the shared directory.
big = jax.device_put(np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024),
                     NamedSharding(Mesh(np.array(first), ("d",)), P()))
for name, source in (("replicated", a), ("rows", rows), ("big", big)):
    b = jax.device_put(source, NamedSharding(Mesh(np.array(second), ("d",)), P()))
    emit(name + "_devices", [s.device.id for s in b.addressable_shards])
    for i, shard in enumerate(b.addressable_shards):
        emit(f"{name}_{i}", np.asarray(shard.data))
"""


def test_a_replicated_copy_to_another_slice_fills_every_device(fleet):
    """The copy pulls each box once per worker (a large one through a file, the workers
    being on the controller's machine) and copies it to the worker's other devices: every
    device of the target slice holds the whole array."""
    out = run_snippet(COPY_ACROSS, fleet.address)
    small = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    big = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    for name, expected in (("replicated", small), ("rows", small), ("big", big)):
        assert len(out[f"{name}_devices"]) == 2 and len(set(out[f"{name}_devices"])) == 2
        for i in range(2):
            np.testing.assert_array_equal(out[f"{name}_{i}"], expected)
