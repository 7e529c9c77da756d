"""Recent fleet events for the web view: a bounded ring fed by the isthmus loggers.

The code that acts already logs each event once, marked with `logs.event` (a worker joined
or was lost, a restart, a group forming or formed, a compile, a lease granted or ended, a
slice reclaimed or returned); warnings and errors are kept too. Records come from any
thread (the launcher's watcher logs from its own), so the ring is read under the handler's
lock.
"""

from __future__ import annotations

import collections
import logging
from typing import Any


class EventLog(logging.Handler):
    """The last `capacity` events, oldest first."""

    def __init__(self, capacity: int = 200) -> None:
        super().__init__(logging.INFO)
        self._ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._count = 0

    def emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, "event", None)
        if kind is None and record.levelno < logging.WARNING:
            return  # an INFO line that is no event (a session opened, say)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record must not break its caller
            self.handleError(record)
            return
        self._count += 1
        fields = getattr(record, "event_fields", None)
        self._ring.append({
            "seq": self._count, "time": record.created, "level": record.levelname.lower(),
            "kind": kind or record.levelname.lower(), "logger": record.name,
            "message": message, "fields": dict(fields) if isinstance(fields, dict) else {}})

    def recent(self) -> list[dict[str, Any]]:
        with self.lock:  # type: ignore[union-attr]
            return list(self._ring)

    @property
    def count(self) -> int:
        """Events seen since start (more than the ring holds, once it is full)."""
        return self._count
