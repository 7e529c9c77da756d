"""What the controller counts as it happens, for the server's metrics (`isthmus/observe`).

Counting sits on the dispatch path, so each count is a plain integer add or one bucket
increment; everything else (sums per slice, the histogram's cumulative form, rates) is
worked out when someone reads the figures. State that can be read when asked (sessions,
workers, queues) is not kept here.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import Any

# Upper bounds (seconds) of the program-latency buckets: from a small program on a fast
# device to a step of a minute.
PROGRAM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)


class Counts:
    """Counters of one controller. Read them; only the controller and its sessions add."""

    __slots__ = ("put_bytes", "fetch_bytes", "peer_bytes", "compile_hits", "compile_misses",
                 "retired_runs", "program_buckets", "program_seconds", "program_count",
                 "timing")

    def __init__(self) -> None:
        self.put_bytes = 0  # host data placed on devices (per shard stored)
        self.fetch_bytes = 0  # device data read back to the host (per distinct shard)
        self.peer_bytes = 0  # shards moved worker to worker
        # The controller's executable cache: a Compile that found the program compiled for
        # those devices already (from any session), and one that had to compile it.
        self.compile_hits = 0
        self.compile_misses = 0
        # slice -> runs of executables no longer cached (live ones count on themselves).
        self.retired_runs: dict[int, int] = {}
        # Dispatch -> ready of programs whose outputs a client waited for: one count per
        # bucket of PROGRAM_BUCKETS, and one more past the last bound.
        self.program_buckets = [0] * (len(PROGRAM_BUCKETS) + 1)
        self.program_seconds = 0.0
        self.program_count = 0
        # Whether dispatches are stamped for that timing (a timestamp and a list per
        # program): only while someone reads the metrics (`observe.Observer`).
        self.timing = False

    def retire(self, slices: Iterable[int], runs: int) -> None:
        """An executable with `runs` runs over `slices` leaves the cache."""
        if runs:
            for s in slices:
                self.retired_runs[s] = self.retired_runs.get(s, 0) + runs

    def waited(self, groups: Iterable[Any]) -> None:
        """A client's wait on these buffer groups ended well: a program that made one of
        them, and that no wait has timed yet, gives one latency, from its dispatch until
        now. Its outputs share one stamp (`[perf_counter() at dispatch]`), so a program is
        timed once whichever of its outputs is waited for first."""
        now = 0.0
        for group in groups:
            beside = group.beside
            stamp = None if beside is None else beside.dispatched
            if stamp is not None:
                beside.dispatched = None
                if stamp[0]:
                    if not now:
                        now = time.perf_counter()
                    self.observe_program(now - stamp[0])
                    stamp[0] = 0.0

    def observe_program(self, seconds: float) -> None:
        self.program_buckets[bisect.bisect_left(PROGRAM_BUCKETS, seconds)] += 1
        self.program_seconds += seconds
        self.program_count += 1
