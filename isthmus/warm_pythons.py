"""The test suite's warm Pythons (`isthmus.testing`): Pythons that imported jax (and the
server's code) once and fork the scripts and `isthmus up` processes the tests start, so that
each starts in a fraction of the time a fresh interpreter takes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from isthmus.warm_start import WarmStart, WorkerProcess


class ServerError(RuntimeError):
    """The server did not start, or did not stop, as expected."""


WARM_ENV = "ISTHMUS_TEST_WARM_PYTHON"
# What a Python reads from its environment when it starts or imports jax: a warm Python is
# kept per value of these (JAX_BACKEND_TARGET apart: `_warm_python` sets it in the child).
_IMPORT_TIME = ("JAX_", "XLA_", "TF_", "PYTHON", "LD_", "OMP_", "OPENBLAS_", "MKL_",
                "NUMPY_", "TPU_", "CUDA_", "NVIDIA_", "GRPC_", "IFRT_", "ISTHMUS_CLIENT_")


class WarmPythons:
    """Pythons that imported jax and fork a process per script (`isthmus/_warm_python.py`),
    one per value of the variables read at import (`_IMPORT_TIME`), the last few kept."""

    KEEP = 4

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._pythons: dict[tuple[tuple[str, str], ...], _WarmPython] = {}

    @staticmethod
    def _key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, v) for k, v in env.items()
                            if k.startswith(_IMPORT_TIME) and k != "JAX_BACKEND_TARGET"))

    def run(self, script: str, argv: list[str], env: dict[str, str], timeout: float
            ) -> subprocess.CompletedProcess[str]:
        key = self._key(env)
        with self._lock:
            python = self._pythons.pop(key, None)
            if python is None or not python.alive():
                python = _WarmPython(env)
            self._pythons[key] = python  # the most recently used last
            while len(self._pythons) > self.KEEP:
                self._pythons.pop(next(iter(self._pythons))).close()
        return python.run(script, argv, env, timeout)

    def close(self) -> None:
        with self._lock:
            for python in self._pythons.values():
                python.close()
            self._pythons.clear()


class _WarmPython:
    """One warm Python and the thread that reads its replies."""

    def __init__(self, env: dict[str, str]) -> None:
        import itertools
        import json
        import threading

        self._json = json
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "_warm_python.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            text=True, bufsize=1)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._started: dict[int, Any] = {}  # request id -> the child's pid, once told
        self._ended: dict[int, int] = {}  # pid -> exit code
        self._changed = threading.Condition(self._lock)
        self._ready = False
        threading.Thread(target=self._read, daemon=True, name="warm-python").start()
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or not self.alive(), 60):
                raise ServerError("the warm Python did not start within 60 s")
        if not self._ready:
            raise ServerError(f"the warm Python ended at start: {self._stderr()}")

    def _stderr(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self._process.poll() is None

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = self._json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = True
                elif "id" in message:
                    self._started[message["id"]] = message["pid"]
                else:
                    self._ended[message["pid"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def run(self, script: str, argv: list[str], env: dict[str, str], timeout: float
            ) -> subprocess.CompletedProcess[str]:
        deadline = time.monotonic() + timeout
        command = [sys.executable, script, *argv]
        with tempfile.TemporaryDirectory(prefix="isthmus-run-") as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = {"id": next(self._ids), "script": script, "argv": argv, "env": env,
                       "cwd": os.getcwd(), "stdout": out, "stderr": err}
            assert self._process.stdin is not None
            with self._changed:
                self._process.stdin.write(self._json.dumps(request) + "\n")
                self._process.stdin.flush()
                self._changed.wait_for(lambda: request["id"] in self._started
                                       or not self.alive(), 60)
                pid = self._started.pop(request["id"], None)
                if pid is None:
                    raise ServerError(f"the warm Python did not start {script}: "
                                      f"{self._stderr()}")
                ended = self._changed.wait_for(
                    lambda: pid in self._ended or not self.alive(),
                    max(0.0, deadline - time.monotonic()))
                if not ended:
                    os.kill(pid, signal.SIGKILL)
                    self._changed.wait_for(lambda: pid in self._ended, 10)
                code = self._ended.pop(pid, None)

            def read(path: str) -> str | None:
                try:
                    with open(path, errors="replace") as f:
                        return f.read()
                except FileNotFoundError:  # the child failed before it became the script
                    return None

            stdout, stderr = read(out), read(err)
        if stdout is None or stderr is None:
            raise ServerError(f"the warm Python's child for {script} ended ({code}) before "
                              f"it ran it: {self._stderr()}")
        if not ended:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        if code is None:
            raise ServerError(f"the warm Python ended while {script} ran: {self._stderr()}")
        return subprocess.CompletedProcess(command, code, stdout, stderr)

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


warm_pythons = WarmPythons()


class _WarmServers:
    """Pythons that imported jax and the server's code, and fork the suite's `isthmus up`
    processes (`warm_start.WarmStart`, `isthmus/warm_worker.py`): a server starts in a fifth
    of the CPU, its vetting process forked from it too (`vetting.ProgramVetter.spawn`). One
    per value of the variables read at import (and of isthmus's own), the last few kept.
    A server of another Python, of an accelerator's platform, or with
    ISTHMUS_TEST_WARM_SERVER=0 starts afresh."""

    ENVIRONMENT = "ISTHMUS_TEST_WARM_SERVER"
    KEEP = 3
    IMPORTS = ("jax", "numpy", "grpc", "isthmus.cli", "isthmus.serve", "isthmus.head",
               "isthmus.launch", "isthmus.frontend.service", "isthmus.frontend.lease_service",
               "isthmus.controller.manager", "isthmus.controller.vetting",
               "isthmus.wire.servicer", "isthmus.wire.h2server", "isthmus.wire.fleet_service",
               "isthmus.worker.host")

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._starters: dict[tuple[tuple[str, str], ...], WarmStart] = {}
        self._log = tempfile.NamedTemporaryFile(prefix="isthmus-warm-servers-", suffix=".log",
                                                delete=False)

    def forkable(self, command: list[str], env: dict[str, str]) -> bool:
        return (command[0] == sys.executable and "--platform" not in command
                and env.get("JAX_PLATFORMS", "cpu") == "cpu"
                and os.environ.get(self.ENVIRONMENT, "1") != "0")

    def start(self, command: list[str], env: dict[str, str], log: str, stdout: str
              ) -> WorkerProcess:
        key = tuple(sorted((k, v) for k, v in env.items()
                           if k.startswith((*_IMPORT_TIME, "ISTHMUS_"))))
        with self._lock:
            starter = self._starters.pop(key, None)
            if starter is None or not starter.alive():
                # C++'s log level is fixed at its first use, and may be in the warm
                # Python: there, as in `isthmus up`, the user's level or else 2.
                quiet = dict(env, TF_CPP_MIN_LOG_LEVEL=env.get("TF_CPP_MIN_LOG_LEVEL") or "2")
                starter = WarmStart(quiet, self._log.name, self.IMPORTS)
            self._starters[key] = starter  # the most recently used last
            while len(self._starters) > self.KEEP:
                self._starters.pop(next(iter(self._starters))).close()
        return starter.start(command, env, log, stdout=stdout, session=True)


warm_servers = _WarmServers()
