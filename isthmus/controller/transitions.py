"""The last moves of the ledger's shards, each with what caused it: a bounded log that
`isthmus status --buffer ID` shows for one buffer.

A move records when it happened, the group and positions it concerned, the states it went
from and to, and its cause: the request being handled then (its kind, op id and session), or
a fleet event the ledger names (a slice lost, taken from a lease). A move outside both (a
worker's answer arriving, a request's work finishing later) records no cause; the entries
before it say which request started that work.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TypedDict

DEFAULT_SIZE = 4096  # moves kept; a few per program run, so the last thousand or so runs

# What caused a move: (request kind, op id, session id), or a fleet event's words.
Cause = tuple[str, int, int] | str


class Entry(TypedDict):
    """One move of a buffer, as `isthmus status --buffer` shows it."""

    at: float  # seconds since the epoch
    positions: list[int] | None  # None: every shard of its group
    old: str | None  # None: the group was made by this move
    new: str
    cause: str


class Transitions:
    """The log (`Ledger.transitions`; groups made by the ledger append to it)."""

    __slots__ = ("_log", "cause")

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        # (time, base, shards in the group, positions or None, old state or None, new, cause)
        self._log: deque[tuple[float, int, int, tuple[int, ...] | None, object, object,
                               Cause | None]] = deque(maxlen=max(size, 1))
        self.cause: Cause | None = None  # what causes the moves now; set around each request

    def record(self, base: int, shards: int, positions: tuple[int, ...] | None,
               old: object, new: object) -> None:
        self._log.append((time.time(), base, shards, positions, old, new, self.cause))

    def record_groups(self, groups: Iterable[tuple[int, int, object]], new: object) -> None:
        """`record` of whole groups, each (base, shards, old state), moving to `new` at once
        (a program run's outputs made, its donated arguments consumed, a step's arrays
        freed): a group that starts where the one before it ended, from the same state, joins
        that one's entry, which `of` reads as it reads one entry per group."""
        log, cause, now = self._log, self.cause, time.time()
        start = end = -1
        state: object = None
        for base, shards, old in groups:
            if base == end and old is state:
                end += shards
                continue
            if end > start:
                log.append((now, start, end - start, None, state, new, cause))
            start, end, state = base, base + shards, old
        if end > start:
            log.append((now, start, end - start, None, state, new, cause))

    @contextlib.contextmanager
    def caused_by(self, cause: Cause) -> Iterator[None]:
        """The moves made inside are recorded with `cause` (a fleet event, a session
        closing); the cause before is restored after."""
        before, self.cause = self.cause, cause
        try:
            yield
        finally:
            self.cause = before

    def __len__(self) -> int:
        return len(self._log)

    def of(self, buffer_id: int) -> list[Entry]:
        """The moves still in the log that concerned `buffer_id`, oldest first."""
        found: list[Entry] = []
        for at, base, shards, positions, old, new, cause in self._log:
            if not base <= buffer_id < base + shards:
                continue
            if positions is not None and buffer_id - base not in positions:
                continue
            found.append(Entry(at=at, positions=None if positions is None else list(positions),
                               old=None if old is None else getattr(old, "value", str(old)),
                               new=getattr(new, "value", str(new)), cause=describe(cause)))
        return found


def describe(cause: Cause | None) -> str:
    if cause is None:
        return "no request: a worker's answer, or work a request started finishing later"
    if isinstance(cause, str):
        return cause
    kind, op_id, session = cause
    return f"{kind} (op {op_id}) of session {session}"
