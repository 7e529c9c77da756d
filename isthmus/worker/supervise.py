"""Keeps a hand-started worker serving across controller crashes.

jaxlib's distributed client aborts its process when the coordination service it belongs to
(which lives in the controller) goes away, so a worker does not survive its controller's
crash by itself. `isthmus worker` therefore runs the worker in a child process and starts it
again when it dies that way: the new child waits up to `--connect-timeout` for a controller
at the same address, and joins it. A worker that was told to leave (the controller stopped
on purpose), refused, or that found no controller within its timeout ends the supervisor
with the same exit code. One that dies after its controller told it to stop (`told_to_stop`:
jaxlib may abort it as the controller's coordination service goes) ends it with 0. Local
fleets (`isthmus up`) and Slurm steps have their own supervisors and run workers directly.

Every child gets the same crash-record path (`worker/crashes.py`): a child that a program
crashed is followed by one that reports the program, and the controller refuses it, so one
bad request costs one restart (and a quick one: it counts toward MAX_QUICK_FAILURES).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from isthmus.worker.crashes import CRASH_RECORD_ENV

FINAL_CODES = {0, 2, 3, 5}  # shutdown, refused, no controller in time, no platform
QUICK_FAILURE = 60.0  # a child that ran less than this and died counts toward the limit
MAX_QUICK_FAILURES = 10
ENVIRONMENT = "ISTHMUS_WORKER_SUPERVISED"
TOLD_TO_STOP = ".told-to-stop"  # beside a child's crash record: its controller stopped it


def told_to_stop() -> None:
    """In a supervised worker: it stops on purpose (its controller told it to, or a stop
    signal), so a death from here on is no crash to recover from: the supervisor ends."""
    record = os.environ.get(CRASH_RECORD_ENV) if os.environ.get(ENVIRONMENT) else None
    if record:
        with open(record + TOLD_TO_STOP, "w"):
            pass


def supervise(argv: Sequence[str], crash_record: str | None = None) -> int:
    """Runs `isthmus worker ARGV` in child processes until one ends for good. The children
    keep their crash records at `crash_record` (None: in a directory made for them)."""
    own = None if crash_record else tempfile.mkdtemp(prefix="isthmus-worker-")
    try:
        return _supervise([sys.executable, "-m", "isthmus.cli", *argv],
                          crash_record or os.path.join(own or "", "worker"))
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def _supervise(command: Sequence[str], crash_record: str) -> int:
    env = {**os.environ, ENVIRONMENT: "1", CRASH_RECORD_ENV: crash_record}
    stopped = crash_record + TOLD_TO_STOP
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    quick_failures, backoff = 0, 1.0
    while True:
        started = time.monotonic()
        if os.path.exists(stopped):
            os.unlink(stopped)
        child = subprocess.Popen(command, env=env)
        code = child.wait()
        if stopping or code in FINAL_CODES:
            return code if code >= 0 else 128 - code
        if os.path.exists(stopped):
            os.unlink(stopped)
            return 0
        ran = time.monotonic() - started
        quick_failures = quick_failures + 1 if ran < QUICK_FAILURE else 0
        if quick_failures > MAX_QUICK_FAILURES:
            print(f"isthmus worker: the worker died {quick_failures} times in a row within "
                  f"{QUICK_FAILURE:g} s of starting; giving up (see its log above)",
                  file=sys.stderr, flush=True)
            return 1
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
               f"exited with code {code}")
        print(f"isthmus worker: the worker {how} (its controller went away?); starting it "
              f"again in {backoff:g} s, to rejoin a controller at the same address",
              file=sys.stderr, flush=True)
        time.sleep(backoff)
        backoff = min(backoff * 2, 8.0) if ran < QUICK_FAILURE else 1.0
        if stopping:
            return 0
