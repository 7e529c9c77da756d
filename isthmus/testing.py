"""Helpers to test code against a real isthmus server in other processes.

    with LocalServer(devices=8) as server:
        result = run_python("import jax; print(jax.device_count())", server.address)

`LocalServer` starts `isthmus up` as a subprocess on a free port and waits (with a timeout)
for its ready line (forked from a Python that imported the server's code already, unless
ISTHMUS_TEST_WARM_SERVER=0); `run_python` runs a script with the stock jax client pointed at it.
Every wait has a timeout, so a hang fails with a message instead of stalling a test suite.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from isthmus.ports import tcp_available
from isthmus.serve import READY_PREFIX, child_environment
from isthmus.warm_start import WarmStart, WorkerProcess


class ServerError(RuntimeError):
    """The server did not start, or did not stop, as expected."""


class LocalServer:
    """An `isthmus up` process on 127.0.0.1 with a free port (on a private Unix socket
    where this machine lets no process open a TCP socket)."""

    def __init__(self, *, devices: int | None = 8, args: Sequence[str] = (),
                 start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 fleet: tuple[int, int, int] | None = None, python: str | None = None
                 ) -> None:
        """`devices`: the embedded backend with that many devices; `fleet`: (slices,
        hosts_per_slice, devices_per_host) worker processes instead; neither: the default
        fleet of `isthmus up`. `python`: the interpreter that runs the server (default: this
        one, or $ISTHMUS_TEST_SERVER_PYTHON, which runs a whole suite against a server on
        another jax)."""
        self.python = python or os.environ.get("ISTHMUS_TEST_SERVER_PYTHON") or sys.executable
        self.devices = devices
        self.fleet = fleet
        self.args = list(args)
        self.start_timeout = start_timeout
        self.env = env
        self.process: WorkerProcess | None = None
        self.address = ""
        self._log = tempfile.NamedTemporaryFile(prefix="isthmus-server-", suffix=".log",
                                                delete=False, mode="w+")
        self._private: str | None = None  # the client socket's folder, where TCP is refused
        self._kept_log: str | None = None  # its end, once the file is removed

    def start(self) -> str:
        if self.fleet is not None:
            slices, hosts, per_host = self.fleet
            shape = ["--slices", str(slices), "--hosts-per-slice", str(hosts),
                     "--devices-per-host", str(per_host)]
        elif self.devices is not None:
            shape = ["--devices", str(self.devices)]
        else:
            shape = []  # the default fleet
        if tcp_available():
            ports = ["--port", "0"]
        else:  # a sandbox without internet sockets: the client port on a Unix socket
            self._private = tempfile.mkdtemp(prefix="isthmus-server-")
            ports = ["--unix-socket", os.path.join(self._private, "client.sock")]
        command = [self.python, "-m", "isthmus.cli", "up", *ports, *shape, *self.args]
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if _warm_servers.forkable(command, env):
            self.address = self._start_forked(command, env)
            return self.address
        process = self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            start_new_session=True)
        assert process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        self.address = self._ready_line(
            lambda: process.stdout.readline() if selector.select(timeout=0.2) else "")
        return self.address

    def _start_forked(self, command: list[str], env: dict[str, str]) -> str:
        """`command` forked from a warm Python (`_WarmServers`); its ready line read from
        the file its standard output goes to."""
        folder = self._private or tempfile.mkdtemp(prefix="isthmus-server-")
        self._private = folder
        stdout = os.path.join(folder, "stdout")
        self.process = _warm_servers.start(command, env, self._log.name, stdout)
        open(stdout, "ab").close()  # there to be read before the child writes to it
        with open(stdout, "rb") as lines:

            def line() -> str:
                text = lines.readline()
                if text.endswith(b"\n"):
                    return text.decode(errors="replace")
                lines.seek(-len(text), os.SEEK_CUR)  # a line still being written
                time.sleep(0.05)
                return ""

            return self._ready_line(line)

    def _ready_line(self, line: Callable[[], str]) -> str:
        """Reads the server's output with `line` (which waits a little, and returns "" when
        there is nothing yet) until its ready line; its address."""
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"isthmus up exited with {self.process.returncode}:\n"
                                  f"{self.log()}")
            text = line()
            if text.startswith(READY_PREFIX):
                return text[len(READY_PREFIX):].strip()
        self.stop()
        raise ServerError(f"isthmus up printed no ready line within {self.start_timeout} s:\n"
                          f"{self.log()}")

    def log(self) -> str:
        if self._kept_log is not None:
            return self._kept_log
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()[-20000:]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stops the server with SIGTERM (SIGKILL after `timeout`); returns its exit code."""
        if self.process is None:
            return None
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout)
                    raise ServerError(f"isthmus up ignored SIGTERM for {timeout} s:\n"
                                      f"{self.log()}") from None
            return self.process.returncode
        finally:
            if self._private is not None:
                shutil.rmtree(self._private, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        from isthmus.wire.servicer import fetch_status

        return fetch_status(self.address)

    # ---- fault injection -------------------------------------------------------------

    def worker_pids(self, slice_index: int) -> list[int]:
        """The pids of the live workers of a slice, by host."""
        status = self.status()
        slots = sorted({d["worker"] for d in status["devices"] if d["slice"] == slice_index})
        return [status["fleet"][str(s)]["pid"] for s in slots if str(s) in status["fleet"]]

    def wait_status(self, condition: Callable[[dict[str, Any]], bool], timeout: float,
                    what: str) -> dict[str, Any]:
        """Polls `status()` until `condition` holds (returns that status); raises
        AssertionError naming `what` ("slice 1 to go down"), with the last status and log."""
        seen: list[dict[str, Any]] = []

        def holds() -> dict[str, Any] | None:
            seen[:] = [self.status()]
            return seen[0] if condition(seen[0]) else None

        return wait_until(holds, timeout, what, interval=0.2, explain=lambda: (
            f"last status: {seen[0] if seen else None}\nserver log:\n{self.log()}"))

    def slice_up(self, slice_index: int) -> bool:
        return str(slice_index) not in self.status()["slices_down"]

    def kill_worker(self, slice_index: int, host: int = 0,
                    sig: int = signal.SIGKILL) -> int:
        """Sends `sig` to a worker of a slice (SIGKILL: a lost host); returns its pid."""
        pid = self.worker_pids(slice_index)[host]
        os.kill(pid, sig)
        return pid

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if exc[0] is None:
            self.check_stopped_cleanly()
            self._kept_log = self.log()  # the file is kept only where something went wrong
            self._log.close()
            os.unlink(self._log.name)

    def check_stopped_cleanly(self) -> None:
        """Raises ServerError if the server's log shows work it left behind at stop: a
        coroutine never awaited, or a task destroyed while pending (every task of a stopping
        server ends, or is cancelled and awaited); or records validate mode found wrong."""
        self._log.flush()
        with open(self._log.name) as f:
            lines = [line for line in f if any(p in line for p in LEFT_BEHIND)]
        if lines:
            raise ServerError("the server left work behind when it stopped:\n"
                              + "".join(lines[:20]) + f"\nserver log:\n{self.log()}")


# What a server's log says of a task or coroutine it left behind, or of records validate mode
# found inconsistent (`check_stopped_cleanly`).
LEFT_BEHIND = ("was never awaited", "Task was destroyed but it is pending", "isthmus validate:")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, *,
               interval: float = 0.05, explain: Callable[[], str] | None = None) -> Any:
    """Polls `predicate` until it returns something true, and returns that; after `timeout`
    seconds raises AssertionError naming `what` ("slice 1 to go down"), with `explain()`.
    The wait for a state a test then asserts on, in place of a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)


def slice_pid(status: dict[str, Any], slice_index: int) -> int | None:
    """The pid of the first live worker of a slice in a server status, or None."""
    for slot in sorted({d["worker"] for d in status["devices"] if d["slice"] == slice_index}):
        entry = status["fleet"].get(str(slot))
        if entry:
            return entry["pid"]
    return None


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def run_python(code: str, address: str | None, *, timeout: float = 120.0,
               env: dict[str, str] | None = None, args: Sequence[str] = ()
               ) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a new Python; with an address, its jax uses that isthmus server.

    The process is forked from a Python that imported jax already (`WarmPythons`) unless
    ISTHMUS_TEST_WARM_PYTHON=0: it is the same as a fresh `python script.py` to the script
    (a new process, its own environment, `__main__`, a normal exit) and starts in a tenth of
    the time."""
    base = dict(os.environ if env is None else env)
    full_env = child_environment(address, base) if address else base
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
        path = f.name
    try:
        if os.environ.get(WARM_ENV, "1") != "0":
            return _warm.run(path, list(args), full_env, timeout)
        return subprocess.run([sys.executable, path, *args], env=full_env, text=True,
                              capture_output=True, timeout=timeout)
    finally:
        os.unlink(path)


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


_warm = WarmPythons()


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
                starter = WarmStart(env, self._log.name, self.IMPORTS)
            self._starters[key] = starter  # the most recently used last
            while len(self._starters) > self.KEEP:
                self._starters.pop(next(iter(self._starters))).close()
        return starter.start(command, env, log, stdout=stdout, session=True)


_warm_servers = _WarmServers()


def run_python_with_pause(code: str, address: str, act: Callable[[str], None], *,
                          timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Runs `code` as `run_python` does, for a test that acts in the middle of it: the code
    prints one line and reads one from stdin; `act(line)` runs in between (a worker is killed,
    say), then the code goes on. Fails fast when the code ends before its line."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
        path = f.name
    client = subprocess.Popen([sys.executable, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_environment(address, dict(os.environ)))
    try:
        assert client.stdout is not None and client.stderr is not None
        line = client.stdout.readline()
        if not line:
            client.wait(timeout)
            return subprocess.CompletedProcess(client.args, client.returncode, "",
                                               client.stderr.read())
        act(line)
        stdout, stderr = client.communicate("go\n", timeout=timeout)
        return subprocess.CompletedProcess(client.args, client.returncode, line + stdout,
                                           stderr)
    finally:
        client.kill()
        client.wait()
        os.unlink(path)
