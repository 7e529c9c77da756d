"""Local CPU workers forked from one warm Python (`isthmus up`'s own fleet).

A worker spends most of its start importing jax and its own code: about 2 s of CPU each,
so a fleet of four on a 2-core machine took 4-5 s before its first worker joined. The local
launcher (`launch.py`) therefore starts one process that imports them once, with no backend
and no thread, and forks each CPU worker from it (`warm_worker.py`, over `forking.py`'s loop):
the child parses the same command line `isthmus worker` would (`cli.main`), in the
environment and with the log the launcher gives it. What it runs is the program a fresh
`python -m isthmus.cli worker` runs; only the imports are done already. A worker that
restarts itself (`execv`) becomes a fresh interpreter in the same process, as before. This
module is the launcher's side.

Only commands of the form `python -m isthmus.cli worker ...` for the CPU platform are forked
(jax reads JAX_PLATFORMS when it is imported, and an accelerator's plugin its environment),
never a shared service's confined workers (they confine themselves before importing jax),
and not when ISTHMUS_WARM_START=0. When the warm Python cannot start, or has died, workers
start as fresh processes, and the log says so.

`isthmus up` forks the warm Python itself from its own process while it still has one thread
and jax imported (`prepare`, called with the vetting process's fork): the warm Python then
imports only the worker's own modules, 0.3 s of CPU instead of 1.5 s. The launcher takes it
(`warm_start_for`); anywhere else a fresh `python -m isthmus.warm_worker` is started.

The warm Python dies with the launcher's process (PR_SET_PDEATHSIG), and its children, which
ask for the same (`--exit-with-parent`), with it. `WarmStart.start` returns a `Forked`, which
answers what the launcher asks of a `subprocess.Popen`: pid, poll, wait, send_signal, kill.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Protocol

from isthmus.forking import exit_status, fork_with_pipes, may_fork

logger = logging.getLogger(__name__)

ENVIRONMENT = "ISTHMUS_WARM_START"  # "0": every worker a fresh interpreter
_PREFIX = ("-m", "isthmus.cli", "worker")
START_TIMEOUT = 60.0  # seconds for the warm Python's imports; past them: fresh processes


class WorkerProcess(Protocol):
    """What the launcher asks of a worker's process (`subprocess.Popen` answers it too)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def forkable(command: Sequence[str], environ: dict[str, str]) -> bool:
    """Whether `command` may be forked from a warm Python: `python -m isthmus.cli worker` on
    the CPU platform, unconfined, with warm starts not turned off."""
    from isthmus.worker.sandbox import ENVIRONMENT as SANDBOX

    return (environ.get(ENVIRONMENT, "1") != "0" and SANDBOX not in environ
            and len(command) > 3 and command[0] == sys.executable
            and tuple(command[1:4]) == _PREFIX and "--platform" not in command)


class Forked:
    """A worker forked by the warm Python: a real process, whose exit the warm Python
    reports (it is that process's parent)."""

    def __init__(self, pid: int, starter: WarmStart) -> None:
        self.pid = pid
        self._starter = starter
        self.returncode: int | None = None
        self.args = ["(forked)", str(pid)]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter.ended(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            code = self._starter.wait_ended(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may be reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStart:
    """The launcher's side: the warm Python, the thread that reads its reports, and the exit
    codes of the children it forked.

    Invariant: a pid is in `_running` from its start until its end is read, then in `_ended`
    until the launcher has seen it; when the warm Python is gone, every child still running
    is reported ended by SIGKILL (they die with it)."""

    def __init__(self, environ: dict[str, str], log_path: str,
                 imports: Sequence[str] = (), *, fork: bool = False) -> None:
        """`imports`: the modules the warm Python imports (default: a CPU worker's).
        `fork`: forked from this process (which the caller knows to have one thread, jax
        imported and no backend) instead of started afresh."""
        self._log = open(log_path, "ab")
        self.log_path = log_path
        self._process: _Process
        if fork:
            self._process = _ForkedPython(self._log.fileno(), imports)
        else:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "isthmus.warm_worker", *imports],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                env={**environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
        self._ids = itertools.count(1)
        self._changed = threading.Condition()
        self._started: dict[int, int] = {}  # request id -> the child's pid
        self._running: set[int] = set()
        self._ended: dict[int, int] = {}
        self._ready = False
        self._gone = False
        threading.Thread(target=self._read, name="isthmus-warm-start", daemon=True).start()
        if not fork:  # a forked one is waited for at its first start (`_wait_ready`)
            self._wait_ready()

    def _wait_ready(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._ready or self._gone, START_TIMEOUT)
            if not self._ready:
                self._process.kill()
                raise OSError(f"the warm Python did not start (see {self.log_path})")

    def alive(self) -> bool:
        with self._changed:
            return not self._gone

    def move_log(self, path: str) -> None:
        """Renames the warm Python's log (a prepared one's, into the fleet's log folder);
        it stays where it is if it cannot be moved."""
        try:
            os.replace(self.log_path, path)
            self.log_path = path
        except OSError:
            pass

    def start(self, command: Sequence[str], environ: dict[str, str], log_path: str, *,
              stdout: str | None = None, session: bool = False) -> Forked:
        """Forks `command` (`python -m isthmus.cli ...`) with this environment, its output
        appended to `log_path` (its standard output to `stdout`, if given; `session`: in a
        session of its own). Raises OSError when the warm Python is gone."""
        self._wait_ready()
        ident = next(self._ids)
        request: dict[str, object] = {"id": ident, "argv": list(command[3:]), "env": environ,
                                      "cwd": os.getcwd(), "log": log_path}
        if stdout is not None:
            request["stdout"] = stdout
        if session:
            request["session"] = True
        with self._changed:
            if self._gone or self._process.stdin is None:
                raise OSError("the warm Python has ended")
            try:
                self._process.stdin.write((json.dumps(request) + "\n").encode())
                self._process.stdin.flush()
            except (OSError, ValueError) as e:
                raise OSError(f"the warm Python has ended: {e}") from e
            self._changed.wait_for(lambda: ident in self._started or self._gone,
                                   START_TIMEOUT)
            pid = self._started.pop(ident, None)
            if pid is None:
                raise OSError("the warm Python did not fork the worker")
            return Forked(pid, self)

    def ended(self, pid: int) -> int | None:
        with self._changed:
            return self._ended.pop(pid, None)

    def wait_ended(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended, timeout)
            return self._ended.pop(pid, None)

    def close(self, timeout: float = 10.0) -> None:
        """Ends the warm Python (its children, if any are left, die with it)."""
        if self._process.stdin is not None:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = True
                elif "id" in message:
                    self._started[message["id"]] = message["pid"]
                    self._running.add(message["pid"])
                else:
                    self._running.discard(message["pid"])
                    self._ended[message["pid"]] = message["code"]
                self._changed.notify_all()
        self._process.wait()
        with self._changed:
            self._gone = True
            for pid in self._running:
                self._ended.setdefault(pid, -signal.SIGKILL)
            self._running.clear()
            self._changed.notify_all()


def start_process(starter: WarmStart | None, command: Sequence[str], environ: dict[str, str],
                  log_path: str) -> WorkerProcess:
    """The worker's process: forked by `starter` where it can be, else a fresh one."""
    if starter is not None and forkable(command, environ):
        try:
            return starter.start(command, environ, log_path)
        except OSError as e:
            logger.warning("a warm start failed (%s); starting the worker afresh", e)
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                env=environ)


def warm_start_for(command: Sequence[str], environ: dict[str, str], folder: str
                   ) -> WarmStart | None:
    """A warm Python for the workers of `command`'s kind (the one `prepare` forked, if any),
    or None where they cannot be forked (or it did not start: the log says why)."""
    prepared = _PREPARED.pop() if _PREPARED else None
    if not forkable(command, environ):
        if prepared is not None:
            prepared.close()
        return None
    if prepared is not None:
        if prepared.alive():
            prepared.move_log(os.path.join(folder, "warm-start.log"))
            return prepared
        prepared.close()
    try:
        return WarmStart(environ, os.path.join(folder, "warm-start.log"))
    except OSError as e:
        logger.warning("%s; workers start as fresh processes", e)
        return None


# ---- a warm Python forked from `isthmus up` itself -----------------------------------------

_PREPARED: list[WarmStart] = []  # forked by `prepare`, for the launcher to take


def prepare(environ: dict[str, str]) -> None:
    """Forks the warm Python of a local CPU fleet's workers from this process, for the
    launcher to take (`warm_start_for`). The caller (`isthmus up`, first thing) has imported
    jax and has one thread and no backend; `environ`: the workers' environment (nothing is
    prepared where it turns warm starts off). A failure is logged: the launcher then starts
    a fresh one."""
    if environ.get(ENVIRONMENT, "1") == "0" or _PREPARED or not may_fork():
        return
    import tempfile

    handle, path = tempfile.mkstemp(prefix="isthmus-warm-start-", suffix=".log")
    os.close(handle)
    try:
        _PREPARED.append(WarmStart(environ, path, fork=True))
    except OSError as e:
        logger.warning("%s; the fleet's workers start as fresh processes", e)
    else:
        import atexit

        atexit.register(_discard_prepared)


def _discard_prepared() -> None:
    """At exit: a prepared warm Python that no launcher took (the server stopped first) ends,
    and its log goes with it."""
    while _PREPARED:
        prepared = _PREPARED.pop()
        prepared.close(1.0)
        try:
            os.unlink(prepared.log_path)
        except OSError:
            pass


class _Process(Protocol):
    """What `WarmStart` asks of the warm Python's process (`subprocess.Popen` answers it)."""

    stdin: IO[bytes] | None
    stdout: IO[bytes] | None

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _ForkedPython:
    """The warm Python forked from this process: `warm_worker.main` in the child, its stdin
    and stdout pipes to this one, its stderr the log, jax's platform CPU (jax was imported
    with this process's environment)."""

    def __init__(self, log: int, imports: Sequence[str]) -> None:
        def become_warm_python() -> None:  # what `python -m isthmus.warm_worker` runs
            import runpy

            import jax

            jax.config.update("jax_platforms", "cpu")
            sys.argv = [sys.argv[0], *imports]
            print(f"isthmus warm start: forked from the server (pid {os.getpid()})",
                  file=sys.stderr, flush=True)
            runpy.run_module("isthmus.warm_worker", run_name="__main__", alter_sys=True)

        self.pid, requests_write, replies_read = fork_with_pipes(become_warm_python, log)
        self.stdin: IO[bytes] | None = os.fdopen(requests_write, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(replies_read, "rb")
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            self._code = exit_status(self.pid)
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["(forked warm Python)"], timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
