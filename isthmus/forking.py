"""The loop of a process that forks a child per request: one warm Python, many fresh ones.

A Python that has imported jax (and, for a worker, isthmus's own code) once can start each
further process in a tenth of the time a new interpreter takes, by forking. Two such
processes use this loop: the test suite's client starter (`isthmus/_warm_python.py`) and the
local fleet's worker starter (`isthmus/warm_worker.py`). It imports only the standard
library, so that a test's client stays a plain jax client.

The loop runs on the process's only thread (a fork copies no other thread's locks):
requests and ended children are both waited for in one `select`, SIGCHLD waking it through
a wakeup fd. Requests and replies are JSON lines on the process's stdin and stdout, which
the loop moves to descriptors of its own first: {"id", ...} in; {"id", "pid"} once the
child is forked, {"pid", "code"} once it has ended (code as subprocess reports it: negative
for a signal); {"ready": true} once, when the loop starts.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any


class Control:
    """The request and reply descriptors, moved off 0 and 1 so that a child's standard
    streams can be its own."""

    def __init__(self) -> None:
        self.requests, self.replies = os.dup(0), os.dup(1)

    def reply(self, message: dict[str, Any]) -> None:
        os.write(self.replies, (json.dumps(message) + "\n").encode())

    def close(self) -> None:
        os.close(self.requests)
        os.close(self.replies)


def redirect(stdout: str, stderr: str, *, append: bool = False) -> None:
    """In a child: stdin from /dev/null, stdout and stderr to these files."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, mode, 0o600)
        os.dup2(out, fd)
        os.close(out)


def exit_like_the_interpreter(code: int) -> None:
    """Ends a child as the interpreter's exit would, without its last step: it waits for
    the non-daemon threads, runs the atexit handlers and flushes the standard streams, then
    leaves without tearing down every module jax imported (a fifth of a second each time,
    and nothing a program can observe: objects still alive then are not finalized either
    way)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


def exit_code(error: SystemExit) -> int:
    """The exit code a SystemExit gives, as the interpreter works it out (a message is
    printed and gives 1)."""
    code = error.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def serve(control: Control, child: Callable[[dict[str, Any]], int]) -> None:
    """Forks a child per request, which runs `child(request)` and exits with its code
    (`exit_like_the_interpreter`); reports starts and ends. Returns when stdin closes (the
    caller went away), without waiting for the children."""
    # What this process imported is kept for its life: out of the collector's sight
    # (`gc.freeze`), a child's collections walk only what the child makes (a full one over
    # jax's imports took ~70 ms of each child), and touch none of the pages it shares.
    gc.collect()
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    control.reply({"ready": True})
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([control.requests, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in ready:
            os.read(wake_read, 4096)
        _reap(control)
        if control.requests not in ready:
            continue
        chunk = os.read(control.requests, 1 << 20)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                control.close()
                try:
                    code = child(request)
                except BaseException:  # noqa: BLE001 - a child never returns to this loop
                    traceback.print_exc()
                    code = 1
                exit_like_the_interpreter(code)
            control.reply({"id": request["id"], "pid": pid})


def _reap(control: Control) -> None:
    """Reports every child that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control.reply({"pid": pid, "code": os.waitstatus_to_exitcode(status)})


# ---- a helper forked from a server ------------------------------------------------------

def may_fork() -> bool:
    """Whether this process may fork a helper that goes on to run jax: jax imported already
    (else a fresh interpreter costs the same), one Python thread, and no jax backend (whose
    native threads a fork would not copy)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return threading.active_count() == 1 and not xla_bridge.backends_are_initialized()


def exit_status(pid: int) -> int | None:
    """A child of this process's exit code as subprocess reports it (negative for a signal;
    -SIGKILL when someone else reaped it), reaping it; None while it runs."""
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped by someone else: gone, how is not known
        return -signal.SIGKILL
    return os.waitstatus_to_exitcode(status) if reaped else None


class ForkedChild:
    """A helper forked from this process (`fork_child`), with its standard input and output
    as asyncio streams: what `asyncio.subprocess.Process` offers, for this pid."""

    def __init__(self, pid: int, stdin: Any, stdout: Any, transports: list[Any]) -> None:
        self.pid = pid
        self.stdin = stdin  # asyncio.StreamWriter
        self.stdout = stdout  # asyncio.StreamReader
        self._transports = transports
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            self._code = exit_status(self.pid)
            if self._code is not None:
                for transport in self._transports:
                    transport.close()
        return self._code

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        import asyncio

        while (code := self.returncode) is None:
            await asyncio.sleep(0.01)
        return code


def fork_with_pipes(target: Callable[[], None], stderr: int | None = None
                    ) -> tuple[int, int, int]:
    """Forks this process, which the caller knows to be safe to fork (one Python thread, no
    native thread but fork-safe ones such as OpenBLAS's pool). The child gets pipes as its
    standard input and output, `stderr` (a descriptor; default /dev/null) as its error, no
    other descriptor, and SIGINT, SIGTERM and SIGCHLD as a fresh Python has them (SIGPIPE
    stays ignored, as Python starts), runs `target()` and exits (code 0, or 1
    after an exception), never returning to the caller. Returns the child's pid and this
    side's ends: the descriptor to write its input to, the one to read its output from."""
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
                signal.signal(number, signal.SIG_DFL)
            error = os.open(os.devnull, os.O_WRONLY) if stderr is None else stderr
            for source, fd in ((requests_read, 0), (replies_write, 1), (error, 2)):
                os.dup2(source, fd)
            for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                if fd > 2:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            target()
            code = 0
        finally:
            os._exit(code)
    os.close(requests_read)
    os.close(replies_write)
    return pid, requests_write, replies_read


async def fork_child(target: Callable[[], None]) -> ForkedChild:
    """`fork_with_pipes(target)`, its pipes as asyncio streams. Called from a running asyncio
    loop."""
    import asyncio

    pid, requests_write, replies_read = fork_with_pipes(target)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    out, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                          os.fdopen(replies_read, "rb", 0))
    into, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin,  # what makes the writer's drain() wait
        os.fdopen(requests_write, "wb", 0))
    writer = asyncio.StreamWriter(into, protocol, None, loop)
    return ForkedChild(pid, writer, reader, [out, into])
