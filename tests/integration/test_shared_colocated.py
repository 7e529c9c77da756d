"""Colocated Python on a shared service (issue 38, item 3): per tenant, off by default, and
confined.

Before, every tenant could run colocated Python, and a tenant's function read the controller's
command line, the tenants file and another tenant's token file, then leased slices as that
tenant. Now a tenant runs colocated Python only where the tenants file allows it, and its
function runs in a worker confined with Landlock (`worker/sandbox.py`): it computes as before,
and every secret it tries is out of reach.
"""

from __future__ import annotations

import os

import pytest

from isthmus.testing import run_python, wait_until
from isthmus.worker import sandbox
from tests.integration.shared_service import EXPECTED, JOB, SharedService, result_of

pytestmark = [pytest.mark.skipif(sandbox.unavailable() is not None,
                                 reason=f"no Landlock here: {sandbox.unavailable()}"),
              pytest.mark.one_environment]  # the server's own code: one environment runs it

THIEF = """
import os, jax, numpy as np
from jax.experimental import colocated_python as cp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
cpu = cp.colocated_cpu_devices(jax.devices())
rows = NamedSharding(Mesh(np.array(cpu), ("x",)), P("x"))
x = jax.device_put(np.arange(8.0).reshape(4, 2), rows)
SECRETS = {secrets!r}

@cp.colocated_python
def steal(x):
    got = []
    for path in SECRETS:
        try:
            with open(path, "rb") as f:
                got.append(f.read(4096))
        except OSError:
            got.append(None)
    stolen = sum(value is not None for value in got)
    shards = [jax.device_put(np.asarray(s.data) * 2 + stolen, s.device)
              for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

print("RESULT", np.asarray(steal(x)).tolist())
"""
TENANTS = {"alice": {"max_slices": 1, "colocated_python": True}, "bob": {"max_slices": 1}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with SharedService(tmp_path_factory.mktemp("tenants"), (2, 1, 2), TENANTS) as server:
        yield server


def _run(service, who, secrets=()):
    with service.lease(who, slices=1) as grant:
        return run_python(THIEF.format(secrets=list(secrets)), grant.target, timeout=180)


def test_a_lease_that_ran_its_own_code_ends_with_its_workers(service):
    """The next tenant on those slices gets fresh worker processes; a lease of a tenant
    without colocated Python leaves its workers as they are. (The module's first test: no
    earlier lease's renewal to wait for.)"""
    def pids():
        return {s: tuple(service.worker_pids(s)) for s in (0, 1)}

    def free():
        return service.status()["shared"]["capacity_free"] == 2

    wait_until(free, 120, "both slices to be free")
    before = pids()
    with service.lease("alice", slices=1) as grant:
        ran = run_python(THIEF.format(secrets=[]), grant.target, timeout=180)
        (mine,) = grant.slices
    assert ran.returncode == 0, ran.stderr[-3000:]
    service.wait_status(
        lambda s: str(mine) not in s["slices_down"] and all(
            pid not in before[mine] for pid in service.worker_pids(mine))
        and len(service.worker_pids(mine)) == len(before[mine]),
        120, f"slice {mine}'s workers to be replaced by fresh ones")
    other = 1 - mine
    assert pids()[other] == before[other]  # not the other slice's
    assert "was lost" not in service.log()  # a retirement, not a failure
    # bob's lease on the renewed slice works, and leaves the workers in place.
    renewed = pids()
    with service.lease("bob", slices=1) as grant:
        job = run_python(JOB, grant.target, timeout=180)
    assert result_of(job) == EXPECTED
    # A slice is free once its lease's scrub is done, and a renewal is part of the scrub.
    wait_until(free, 60, "bob's slice to be scrubbed and free")
    assert pids() == renewed


def test_a_tenant_without_colocated_python_is_refused_and_told_why(service):
    result = _run(service, "bob")
    assert result.returncode != 0
    assert "PERMISSION_DENIED" in result.stderr or "Permission" in result.stderr, \
        result.stderr[-3000:]
    assert "colocated_python = true" in result.stderr, result.stderr[-3000:]
    assert "[tenants.bob]" in result.stderr


def test_a_tenants_function_runs_confined_and_reads_no_secret(service):
    controller = service.process.pid
    secrets = [str(service.directory / "bob.token"), str(service.directory / "tenants.toml"),
               f"/proc/{controller}/cmdline", f"/proc/{controller}/environ",
               str(service.directory / "isthmus-service" / "service-key.pem"),
               os.path.abspath(__file__)]
    assert all(os.path.exists(p) for p in secrets[:4]), secrets
    result = _run(service, "alice", secrets)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    # It ran (each value doubled), and read none of them (nothing added).
    assert line == f"RESULT {[[2.0 * (2 * i), 2.0 * (2 * i + 1)] for i in range(4)]}", line
