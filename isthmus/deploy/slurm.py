"""`isthmus slurm`: a fleet inside one Slurm allocation.

Run from a batch script (`examples/slurm/isthmus.sbatch`). This process becomes the
controller on the allocation's first node. One `srun` step starts a worker per task
(`--ntasks`, one per node or one per GPU). Task k joins slice k // hosts_per_slice, so
consecutive tasks (Slurm's node order) share a slice. The fleet token is generated here when
the job has none, and reaches the workers through the step's environment (srun exports it).
With a command after `--`, the command runs as the client in the job and the fleet stops
when it ends. Without one, the fleet serves until the job is cancelled, and clients outside
the job connect to the address written to `--address-file`. With `--tenants FILE` the
controller is a shared service (docs/shared.md) at that same address: tenants lease slices
with `isthmus run --service`, over TLS with the certificate it is given or makes.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

from isthmus.ports import free_port
from isthmus.transport.auth import TOKEN_ENVIRONMENT


@dataclasses.dataclass(frozen=True, slots=True)
class SlurmFleet:
    """What the allocation gives: workers (tasks), their grouping into slices, this node."""

    job_id: str
    workers: int
    hosts_per_slice: int
    devices_per_host: int
    host: str  # where workers and clients reach the controller
    port: int

    @property
    def slices(self) -> int:
        return self.workers // self.hosts_per_slice


def plan(environ: Mapping[str, str], hosts_per_slice: int, devices_per_host: int,
         port: int) -> SlurmFleet:
    """Reads the allocation; ValueError (one line for the user) when it does not fit."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        raise ValueError("isthmus slurm runs inside a Slurm allocation (SLURM_JOB_ID is not "
                         "set): submit it with sbatch, e.g. sbatch examples/slurm/isthmus.sbatch")
    try:
        workers = int(environ.get("SLURM_NTASKS") or environ["SLURM_JOB_NUM_NODES"])
    except (KeyError, ValueError):
        raise ValueError("the allocation names no task count (SLURM_NTASKS); give sbatch "
                         "--ntasks or --nodes") from None
    if hosts_per_slice < 1 or devices_per_host < 1:
        raise ValueError("--hosts-per-slice and --devices-per-host must be at least 1")
    if workers % hosts_per_slice:
        raise ValueError(f"the allocation has {workers} tasks, not a multiple of "
                         f"--hosts-per-slice {hosts_per_slice}; change one of them")
    host = environ.get("SLURMD_NODENAME") or socket.gethostname()
    return SlurmFleet(job, workers, hosts_per_slice, devices_per_host, host,
                      port or free_port("0.0.0.0"))


def worker_step(fleet: SlurmFleet, worker_options: Sequence[str]) -> list[str]:
    """The srun command line that starts every worker of the fleet."""
    worker = [sys.executable, "-m", "isthmus.cli", "worker", "--controller",
              f"{fleet.host}:{fleet.port}", "--devices", str(fleet.devices_per_host),
              "--listen", "0.0.0.0", "--no-supervise", *worker_options]
    # Each task computes its slice from its rank, and advertises its own node's name.
    script = (f'exec {shlex.join(worker)} --slice $((SLURM_PROCID / {fleet.hosts_per_slice}))'
              ' --advertise "$(hostname)"')
    return ["srun", f"--ntasks={fleet.workers}", "--kill-on-bad-exit=0",
            f"--job-name=isthmus-workers-{fleet.job_id}", "bash", "-c", script]


def server_arguments(fleet: SlurmFleet, platform_options: Sequence[str],
                     command: Sequence[str], service_options: Sequence[str] = ()) -> list[str]:
    """`isthmus run`/`up` options for the controller of this fleet; `service_options`
    (`--tenants FILE ...`) make it a shared service, which serves until the job ends."""
    if service_options and command:
        raise ValueError("a shared service (--tenants) serves its tenants until the job ends: "
                         "drop the command after --, and run clients with isthmus run "
                         "--service HOST:PORT (docs/shared.md)")
    head = ["run" if command else "up", "--no-launch", "--host", "0.0.0.0",
            "--advertise-host", fleet.host, "--port", str(fleet.port),
            "--slices", str(fleet.slices), "--hosts-per-slice", str(fleet.hosts_per_slice),
            "--devices-per-host", str(fleet.devices_per_host), *platform_options,
            *service_options]
    return [*head, "--", *command] if command else head


def start_workers(fleet: SlurmFleet, worker_options: Sequence[str],
                  environ: dict[str, str]) -> subprocess.Popen[bytes]:
    if not environ.get(TOKEN_ENVIRONMENT):
        environ[TOKEN_ENVIRONMENT] = secrets.token_hex(32)  # srun exports it to the tasks
    return subprocess.Popen(worker_step(fleet, worker_options), env=environ)


def stop_workers(step: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Ends the worker step: the stopping controller has told its workers to leave, so the
    step usually ends by itself; otherwise srun passes SIGTERM on to every task."""
    try:
        step.wait(10.0)
    except subprocess.TimeoutExpired:
        pass
    if step.poll() is None:
        step.terminate()
        try:
            step.wait(timeout)
        except subprocess.TimeoutExpired:
            step.kill()
            step.wait(timeout)



def write_address(path: str | None, fleet: SlurmFleet) -> None:
    if path:
        with open(path, "w") as f:
            f.write(f"grpc://{fleet.host}:{fleet.port}\n")
        os.chmod(path, 0o600)
