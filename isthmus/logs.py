"""How isthmus processes write their logs: `--log-format text` (the default, for people) or
`json` (one JSON object per line, for log collectors).

A JSON line has `time` (ISO 8601, UTC), `level`, `logger`, `message`, and, for the fleet's
events, `event` with the record's own fields: `worker_joined`, `worker_lost`,
`worker_crashed`, `worker_restarted`, `group_forming`, `group_formed`, `compiled`,
`lease_granted`, `lease_ended`, `lease_resumed`, `slice_reclaimed`, `slice_returned`.
Code marks an event with `logger.info(..., extra=event("worker_lost", slice=1))`.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """`extra=` for a log call that records a fleet event."""
    return {"event": kind, "event_fields": fields}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(
                record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        kind = getattr(record, "event", None)
        if kind is not None:
            line["event"] = kind
            line.update(getattr(record, "event_fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str, fmt: str = "text", text: str = TEXT) -> None:
    """The process's log handler (only the command line calls this). In JSON, the fleet's
    events are written whatever the level: collectors want them, and they are few."""
    handler = logging.StreamHandler()
    threshold = logging.getLevelName(level.upper())
    if not isinstance(threshold, int):
        raise ValueError(f"--log-level {level} is not a level (DEBUG, INFO, WARNING, ERROR)")
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
        handler.addFilter(lambda record: record.levelno >= threshold
                          or getattr(record, "event", None) is not None)
        threshold = min(threshold, logging.INFO)  # events are logged at INFO
    else:
        handler.setFormatter(logging.Formatter(text))
    logging.basicConfig(level=threshold, handlers=[handler])
