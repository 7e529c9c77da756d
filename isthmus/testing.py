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
from isthmus.warm_pythons import WARM_ENV, ServerError, warm_pythons, warm_servers
from isthmus.warm_start import WorkerProcess


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
        if warm_servers.forkable(command, env):
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
        self.process = warm_servers.start(command, env, self._log.name, stdout)
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
            return warm_pythons.run(path, list(args), full_env, timeout)
        return subprocess.run([sys.executable, path, *args], env=full_env, text=True,
                              capture_output=True, timeout=timeout)
    finally:
        os.unlink(path)


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


def run_isthmus(args: Sequence[str], *, env: dict[str, str] | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Runs `python -m isthmus.cli ARGS` to its end and returns what it printed, as
    `subprocess.run(..., capture_output=True, text=True)` does.

    The command is forked from the warm Python of the suite's servers (`LocalServer`'s, which
    imported jax and the server's code once), in a session of its own, unless it cannot be
    (an accelerator's platform, ISTHMUS_TEST_WARM_SERVER=0): then it is a fresh interpreter.
    Either way it is `isthmus` as a user runs it: its own process, environment, working
    directory, exit code and output. After `timeout` seconds its session is killed and
    `subprocess.TimeoutExpired` raised, with what it had printed."""
    command = [sys.executable, "-m", "isthmus.cli", *args]
    full_env = dict(os.environ if env is None else env)
    if not warm_servers.forkable(command, full_env):
        return subprocess.run(command, capture_output=True, text=True, env=full_env,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="isthmus-cli-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")

        def read(path: str) -> str:
            try:
                with open(path, errors="replace") as f:
                    return f.read()
            except FileNotFoundError:  # it ended before its output was redirected
                return ""

        process = warm_servers.start(command, full_env, err, out)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the command and what it started
            except ProcessLookupError:
                pass
            process.wait(10)
            raise subprocess.TimeoutExpired(command, timeout, output=read(out),
                                            stderr=read(err)) from None
        return subprocess.CompletedProcess(command, code, read(out), read(err))
