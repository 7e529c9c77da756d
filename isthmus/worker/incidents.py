"""A worker's errors reach the controller's log, not only its own.

A worker's log is a file in a temporary directory (or wherever its launcher put it) that a
user rarely opens: a command that raised there used to leave a client waiting with nothing
said anywhere it looked. `IncidentForwarder` is a logging handler the worker installs for
each membership: every record at ERROR or above, and every record with a traceback, travels
to the controller as an `Incident` (`transport/messages.py`), which the controller logs at
its default level with the worker's name and log path (`RemoteWorker.on_message`). At most
BURST incidents go per PERIOD seconds; the rest are counted and the next one that goes says
how many were left in the worker's log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
import traceback
from collections.abc import Callable

from isthmus.transport import messages as m

BURST = 20  # incidents forwarded per PERIOD
PERIOD = 10.0  # seconds
TEXT_LIMIT = 16_000  # characters of a traceback forwarded (its end: where it was raised)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def own_log_path() -> str:
    """The file this process's standard error goes to (a launcher's log of this worker),
    or "" when it goes to a terminal, a pipe or nowhere readable."""
    try:
        path = os.readlink("/proc/self/fd/2")
        return path if stat.S_ISREG(os.stat(path).st_mode) else ""
    except OSError:
        return ""


class IncidentForwarder(logging.Handler):
    """Sends error records to the controller through `send`, which runs on the worker's event
    loop `loop`: at once from it (so an incident leaves before the error reply that follows
    it), scheduled there from other threads."""

    def __init__(self, send: Callable[[m.Incident], None], loop: asyncio.AbstractEventLoop
                 ) -> None:
        super().__init__(level=logging.WARNING)
        self._send = send
        self._loop = loop
        self._local = threading.local()  # set while forwarding: a record about sending stays
        self._times: list[float] = []
        self._dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and record.exc_info is None:
            return
        if getattr(self._local, "busy", False):
            return
        self._local.busy = True
        try:
            now = time.monotonic()
            self._times = [t for t in self._times if now - t < PERIOD]
            if len(self._times) >= BURST:
                self._dropped += 1
                return
            self._times.append(now)
            text = ""
            if record.exc_info is not None:
                text = "".join(traceback.format_exception(*record.exc_info))[-TEXT_LIMIT:]
            incident = m.Incident(record.levelname, record.name, record.getMessage()[:4000],
                                  text, self._dropped)
            self._dropped = 0
            if _running_loop() is self._loop:
                self._send(incident)
            else:
                self._loop.call_soon_threadsafe(self._send, incident)
        except Exception:  # noqa: BLE001 - logging must never raise into the code that logs
            pass
        finally:
            self._local.busy = False
