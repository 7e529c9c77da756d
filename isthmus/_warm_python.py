"""A Python with jax imported that forks a fresh process for each script it is given.

`isthmus.testing.run_python` runs many short client scripts; each would spend most of its
time importing jax (0.7 s of 0.9 s for a one-line program on a quiet machine). This process
imports jax and numpy once, creates no backend, and then, for each request on its stdin,
forks a child that takes the request's environment, arguments, working directory and
output files and runs the script as `python script.py` would: as `__main__`, with the
script's folder first on sys.path, ending as the interpreter ends (non-daemon threads
waited for, atexit handlers run, streams flushed: `_exit`) with the script's exit code.

What jax reads from the environment when it is imported cannot change in a child; the
caller keeps one such process per value of those variables (`testing.WarmPythons`), apart
from JAX_BACKEND_TARGET, which the child sets in jax's config. It imports nothing from
isthmus, so a child is a plain jax client.

Requests and replies are JSON lines: {"id", "script", "argv", "env", "cwd", "stdout",
"stderr"} in; {"id", "pid"} when the child started, {"pid", "code"} when it ended (code as
subprocess reports it: negative for a signal).
"""

import atexit
import json
import os
import runpy
import select
import signal
import sys
import threading
import traceback

import jax  # the point of this process (and its config, in the child)
import numpy  # noqa: F401

_CONTROL_IN, _CONTROL_OUT = os.dup(0), os.dup(1)


def _reply(message: dict) -> None:
    os.write(_CONTROL_OUT, (json.dumps(message) + "\n").encode())


def _reap() -> None:
    """Reports every child that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(request: dict) -> int:
    """Runs in the forked child: becomes `python script args...` and returns its code."""
    os.close(_CONTROL_IN)
    os.close(_CONTROL_OUT)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    target = request["env"].get("JAX_BACKEND_TARGET")
    if target is not None:
        jax.config.update("jax_backend_target", target.lower())
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - reported as python reports it
        tb = e.__traceback__  # from the script's frame on, as python prints it
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        return 1
    return 0


def _exit(code: int) -> None:
    """Ends the child as the interpreter's exit would, without its last step: it waits for
    the non-daemon threads, runs the atexit handlers and flushes the standard streams, then
    leaves without tearing down every module jax imported (a fifth of a second each time,
    and nothing a script can observe: objects still alive then are not finalized either
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


def main() -> None:
    """One thread (a fork never copies another's locks): requests and ended children are
    both waited for in one `select`, a SIGCHLD waking it through its wakeup fd."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _reply({"ready": True})
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([_CONTROL_IN, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in ready:
            os.read(wake_read, 4096)
        _reap()
        if _CONTROL_IN not in ready:
            continue
        chunk = os.read(_CONTROL_IN, 1 << 20)
        if not chunk:
            os._exit(0)  # the caller went away
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
                _exit(_child(request))
            _reply({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    main()
