"""The warm Python of a local fleet's CPU workers (`python -m isthmus.warm_worker`).

It imports jax and the worker's code once, with no backend and no thread, then forks a child
per request of its launcher (`warm_start.WarmStart`, over `forking.py`'s loop). The child dies
with it, takes the request's environment, appends to its log, and runs `isthmus worker` with
the request's arguments (`cli.main`). A request is {"id", "argv", "env", "cwd", "log"}, and
optionally "stdout" (a file of its own for the standard output) and "session" (true: a
session of its own, as `start_new_session`).

Its arguments, if any, name the modules to import instead of a worker's: the test suite's
servers (`isthmus.testing.LocalServer`) are `isthmus up` processes forked the same way.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any

_parent = 0  # the warm Python's pid, which its children check once they die with it
# What every worker imports, here once: jax, and the worker's code as `isthmus worker` runs it.
_IMPORTED = ("jax", "numpy", "isthmus.cli", "isthmus.worker.agent", "isthmus.worker.crashes",
             "isthmus.worker.sandbox", "isthmus.worker.supervise")


def _child(request: dict[str, Any]) -> int:
    """In a forked child: `isthmus worker ARGV`, with the request's environment and log."""
    from isthmus import cli, forking
    from isthmus.worker.process import exit_with_parent

    exit_with_parent()  # before anything else: the warm Python gone, this worker goes too...
    if os.getppid() != _parent:  # ... also when it went before that took hold
        os._exit(1)
    if request.get("session"):
        os.setsid()
    forking.redirect(request.get("stdout", request["log"]), request["log"], append=True)
    os.environ.clear()
    os.environ.update(request["env"])
    serve = sys.modules.get("isthmus.serve")
    if serve is not None:  # it read the environment at its import, after jax's
        serve.take_environment(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [sys.executable, *request["argv"]]
    try:
        return cli.main(request["argv"])
    except SystemExit as e:
        return forking.exit_code(e)


def main() -> None:
    from isthmus import forking
    from isthmus.worker.process import exit_with_parent

    global _parent
    exit_with_parent()  # the launcher's process gone: this one too, and its children with it
    _parent = os.getpid()
    control = forking.Control()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing of the imports' on the control channel
    os.close(devnull)
    began = time.monotonic()
    for module in sys.argv[1:] or _IMPORTED:
        importlib.import_module(module)
    what = "processes" if sys.argv[1:] else "workers"
    print(f"isthmus warm start: imports took {time.monotonic() - began:.2f} s; forking "
          f"{what} (pid {os.getpid()})", file=sys.stderr, flush=True)
    forking.serve(control, _child)
    os._exit(0)  # the launcher went away


if __name__ == "__main__":
    main()
