"""`isthmus slurm` under a real Slurm (tools/slurm-local: one node, CPUs oversubscribed):
sbatch of examples/slurm/isthmus.sbatch runs a 2-slice fleet (two worker tasks through srun)
with the client in the job, and again as a service that a client outside the job reaches
through the address file; results are compared with numpy."""

import os
import pathlib
import shutil
import subprocess
import sys

import grpc
import pytest

from isthmus.testing import run_python, wait_until
from isthmus.wire.servicer import fetch_status

ROOT = pathlib.Path(__file__).parents[2]
SBATCH = ROOT / "examples" / "slurm" / "isthmus.sbatch"

CLIENT = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
assert sorted({d.slice_index for d in devices}) == [0, 1], devices
mesh = Mesh(np.array(devices), ("x",))
x = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
out = jax.jit(lambda v: (v * 2).sum(axis=0), out_shardings=NamedSharding(mesh, P()))(x)
np.testing.assert_allclose(np.asarray(out), (np.arange(32.0).reshape(8, 4) * 2).sum(0))
print("CLIENT OK", len(devices))
"""


def slurm_up() -> bool:
    """A Slurm node is idle or in use here; where `scripts/test` is starting one beside the
    tests (ISTHMUS_TEST_SLURM_READY: the file it makes when that is over), once it is."""
    ready = os.environ.get("ISTHMUS_TEST_SLURM_READY")
    if ready:
        wait_until(lambda: os.path.exists(ready), 600, "tools/slurm-local start to end",
                   interval=0.5)
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                            timeout=20)
    return result.returncode == 0 and any(s in result.stdout for s in ("idle", "mix"))


# What this tests is the deployment (sbatch, srun, the address file), which is the same on
# either jax; the one node's two CPUs are shared by both environments' jobs besides.
pytestmark = pytest.mark.one_environment


@pytest.fixture(autouse=True, scope="module")
def _slurm():
    """Skips where there is no Slurm (asked when the tests run, not when they are collected:
    `scripts/test` may still be starting it)."""
    if not slurm_up():
        pytest.skip("no Slurm here (tools/slurm-local start, as root, sets up one)")


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "JAX_", "ISTHMUS_FLEET"))}
    env.update(PYTHON=sys.executable, HOSTS_PER_SLICE="1", DEVICES_PER_HOST="2",
               PYTHONPATH=str(ROOT))
    return env


def test_a_fleet_and_its_client_in_one_job(tmp_path):
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    submitted = subprocess.run(["sbatch", "--parsable", "--ntasks=2", "-o",
                                str(tmp_path / "job.out"), str(SBATCH), sys.executable,
                                str(client)], cwd=tmp_path, env=environment(),
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    # Not `sbatch --wait`: it polls the job at growing intervals (up to 10 s apart).
    wait_until(lambda: not queued(job), 300, f"job {job} to end", interval=0.25)
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                           text=True, timeout=20).stdout
    assert "JobState=COMPLETED" in shown and "ExitCode=0:0" in shown, shown + output[-4000:]
    assert "2 workers in 2 slices" in output, output[-4000:]
    assert "CLIENT OK 4" in output, output[-4000:]


def test_a_client_outside_the_job(tmp_path):
    submitted = subprocess.run(["sbatch", "--parsable", "--ntasks=2", "-o",
                                str(tmp_path / "job.out"), str(SBATCH)], cwd=tmp_path,
                               env=environment(), capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        address_file = tmp_path / f"isthmus-{job}.address"

        def job_output():
            out = tmp_path / "job.out"
            return out.read_text()[-3000:] if out.exists() else "(no job output yet)"

        wait_until(address_file.exists, 180, "the job to write its address file",
                   explain=job_output)
        address = address_file.read_text().strip()
        wait_until(lambda: both_slices_up(address), 180, "both workers to join the fleet",
                   explain=job_output)
        result = run_python(CLIENT, address, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert "CLIENT OK 4" in result.stdout
    finally:
        subprocess.run(["scancel", job], timeout=30)

    wait_until(lambda: not queued(job), 60, f"job {job} to end after scancel",
               interval=0.25, explain=lambda: f"squeue: {queued(job)}")


def queued(job: str) -> str:
    """The job's line in squeue (empty once it has ended)."""
    return subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                          timeout=20).stdout.strip()


def both_slices_up(address: str) -> bool:
    """The fleet lists devices of slices 0 and 1 and none down (False while it is not
    listening yet)."""
    try:
        status = fetch_status(address, timeout=5)
    except grpc.RpcError:
        return False
    return {d["slice"] for d in status["devices"]} == {0, 1} and not status["slices_down"]
