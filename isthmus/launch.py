"""Starting worker processes on this machine (`isthmus up` with a local fleet).

The workers are the same program that Slurm or Kubernetes would start (`isthmus worker`),
with `--exit-with-parent` so that they never outlive the controller that launched them.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

logger = logging.getLogger(__name__)


class LocalLauncher:
    """Starts and stops `isthmus worker` subprocesses."""

    def __init__(self, controller: str, slices: int, hosts_per_slice: int,
                 devices_per_host: int, log_dir: str | None = None) -> None:
        self.controller = controller
        self.slices = slices
        self.hosts_per_slice = hosts_per_slice
        self.devices_per_host = devices_per_host
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="isthmus-workers-"))
        self.processes: list[subprocess.Popen[bytes]] = []

    def command(self, slice_index: int) -> list[str]:
        return [sys.executable, "-m", "isthmus.cli", "worker", "--controller", self.controller,
                "--slice", str(slice_index), "--devices", str(self.devices_per_host),
                "--exit-with-parent"]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET", "XLA_FLAGS")}
        for slice_index in range(self.slices):
            for host in range(self.hosts_per_slice):
                log = open(self.log_dir / f"worker-s{slice_index}-h{host}.log", "ab")
                self.processes.append(subprocess.Popen(
                    self.command(slice_index), stdout=log, stderr=subprocess.STDOUT, env=env))
                log.close()
        logger.info("started %d workers; logs in %s", len(self.processes), self.log_dir)

    def stop(self, timeout: float = 10.0) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        self.processes.clear()
