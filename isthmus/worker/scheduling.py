"""How the OS schedules the thread that carries a worker's CPU collectives.

gloo, which carries XLA:CPU's collectives between processes, runs one event-loop thread per
collective group (`gloo::transport::tcp::Loop`, started when jaxlib makes the group's
collectives). Every message between ranks wakes it, and as an ordinary thread it then
preempts whatever runs on that CPU: on few cores, often one of XLA's device threads in the
middle of the same collective. Measured on two cores with a controller, a client and two
workers: that loop spends 0.2-0.5 ms of CPU per cross-worker reduction in the worker that
starts it later (0.05 ms in the other), and a plain `jnp.sum` over 8 devices takes 1.8 ms.

As SCHED_BATCH the loop keeps its full share of the CPU (same weight; nothing can starve
it) but no longer preempts on wakeup: it runs when a CPU frees or the current thread's slice
ends. Its CPU per reduction drops to 0.06-0.09 ms and the sum to 1.3 ms; the data-parallel
loop of bench/dp_loop.py runs 1.3-1.4x faster. Where other processes keep every CPU busy, a
message waits for their slices instead, and that loop runs 0.6-0.8x as fast as with
`normal`, the OS default, which `--gloo-scheduling normal` (or ISTHMUS_GLOO_SCHEDULING)
keeps. docs/design.md, "gloo's thread"; figures: bench/RESULTS.md, "Issue 27, fourth round".
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

logger = logging.getLogger(__name__)

ENVIRONMENT = "ISTHMUS_GLOO_SCHEDULING"  # the default of `isthmus worker --gloo-scheduling`
CHOICES = ("batch", "normal")
DEFAULT = "batch"

_T = TypeVar("_T")
_making = threading.Lock()  # one group's threads are told apart from another's


def from_environment(environ: Mapping[str, str] = os.environ) -> str:
    """The scheduling named by ISTHMUS_GLOO_SCHEDULING (DEFAULT when unset); ValueError
    names a bad value and the choices."""
    value = environ.get(ENVIRONMENT, "").strip() or DEFAULT
    if value not in CHOICES:
        raise ValueError(f"{ENVIRONMENT}={value!r}: choose {' or '.join(CHOICES)}")
    return value


def _native_threads() -> set[int]:
    """This process's threads (Linux thread ids) that Python did not start; empty where
    /proc is not there."""
    try:
        threads = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    return threads - {t.native_id for t in threading.enumerate() if t.native_id is not None}


def started_by(make: Callable[[], _T]) -> tuple[_T, set[int]]:
    """`make()`, and the threads it started that Python does not know (jaxlib's own)."""
    with _making:
        before = _native_threads()
        made = make()
        return made, _native_threads() - before


def schedule_loop(threads: set[int], scheduling: str) -> int | None:
    """Applies `scheduling` to the gloo loop thread among `threads` (those making the
    group's collectives started): the thread id it applied to, or None. Only a single new
    thread is taken for the loop; more or none (another jaxlib, another platform) leave
    every thread as it is."""
    if scheduling == "normal" or not hasattr(os, "SCHED_BATCH"):
        return None
    if len(threads) != 1:
        logger.info("making the collectives started %d threads, not gloo's one loop; "
                    "their scheduling is left as it is", len(threads))
        return None
    (thread,) = threads
    try:
        os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))
    except OSError as e:  # it has ended, or a sandbox forbids it: only slower
        logger.info("gloo's loop thread %d stays as it is: %s", thread, e)
        return None
    return thread
