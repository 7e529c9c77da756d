"""The hand-started worker's supervisor (`worker/supervise.py`): what ends it, and what makes
it start the worker again. The children here are small scripts standing in for the worker."""

import sys

from isthmus.worker import supervise

# A stand-in child: dies by SIGABRT (as jaxlib aborts a member whose coordination service
# went away), after saying it was told to stop when its argument says so.
CHILD = """
import os, signal, sys
from isthmus.worker import supervise
with open(os.environ[supervise.CRASH_RECORD_ENV] + ".runs", "a") as f:
    f.write("run\\n")
if sys.argv[1] == "stop":
    supervise.told_to_stop()
os.kill(os.getpid(), signal.SIGABRT)
"""


def _runs(record):
    with open(record + ".runs") as f:
        return len(f.read().split())


def test_a_worker_that_dies_after_being_told_to_stop_is_not_started_again(tmp_path):
    record = str(tmp_path / "worker")
    assert supervise._supervise([sys.executable, "-c", CHILD, "stop"], record) == 0
    assert _runs(record) == 1


def test_a_worker_that_dies_otherwise_is_started_again(tmp_path, monkeypatch):
    # Up to the limit on quick failures; the marker of an earlier run does not carry over.
    monkeypatch.setattr(supervise, "MAX_QUICK_FAILURES", 1)
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    record = str(tmp_path / "worker")
    open(record + supervise.TOLD_TO_STOP, "w").close()
    assert supervise._supervise([sys.executable, "-c", CHILD, "crash"], record) == 1
    assert _runs(record) == 2
