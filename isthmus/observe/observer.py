"""What a head starts when it is given a metrics port: the event ring, the loop-lag timer,
the metrics collector and the web server with its routes. Each route reads the server on
the event loop and writes its answer out on a thread beside it."""

from __future__ import annotations

import asyncio
import collections
import importlib.resources
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from isthmus import errors
from isthmus.observe import state
from isthmus.observe.events import EventLog
from isthmus.observe.metrics import Collected, FleetCollector, Reading, families
from isthmus.observe.options import ObserveConfig
from isthmus.observe.sources import Head, Sources
from isthmus.observe.web import WebServer

logger = logging.getLogger(__name__)

# The loggers whose events the view shows (every isthmus module logs under this name).
EVENT_LOGGER = "isthmus"


class LoopLag:
    """How late the event loop runs a timer: one every `interval` s; `value` is the worst
    lateness of the last `window` of them."""

    def __init__(self, interval: float = 0.5, window: int = 10) -> None:
        self.interval = interval
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._schedule(loop, loop.time())

    def _schedule(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        due = now + self.interval
        self._handle = loop.call_at(due, self._tick, loop, due)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        self._recent.append(max(0.0, now - due))
        self._schedule(loop, now)

    def value(self) -> float:
        return max(self._recent, default=0.0)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Observer:
    """Metrics and the live view of one head (`isthmus.head.Head`)."""

    def __init__(self, config: ObserveConfig, head: Head) -> None:
        self.config = config
        self.events = EventLog(config.events)
        self.lag = LoopLag()
        self.sources = Sources(head, self.lag.value)
        self.collector = FleetCollector(self.sources)
        self._page = importlib.resources.files(__package__).joinpath(
            "page.html").read_bytes()
        self._started = time.monotonic()
        self.web = WebServer({"/": self._view, "/index.html": self._view,
                              "/metrics": self._metrics, "/api/state": self._state})
        self.url = ""

    def attach_events(self) -> None:
        """Starts keeping the isthmus loggers' events (before the fleet gathers, so that
        its first joins are seen)."""
        logging.getLogger(EVENT_LOGGER).addHandler(self.events)

    async def start(self) -> str:
        """Serves the routes; returns the base URL."""
        self.attach_events()
        self.lag.start()
        self.sources.live_controller().counts.timing = True
        port = await self.web.start(self.config.host, self.config.port)
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return self.url

    async def stop(self) -> None:
        await self.web.stop()
        self.lag.stop()
        logging.getLogger(EVENT_LOGGER).removeHandler(self.events)

    def _view(self, headers: dict[str, str]) -> tuple[str, bytes]:
        return "text/html; charset=utf-8", self._page

    async def _metrics(self, headers: dict[str, str]) -> tuple[str, bytes]:
        reading = self.collector.read()  # read here, on the loop; written out aside
        text = await asyncio.get_running_loop().run_in_executor(None, _exposition, reading)
        return CONTENT_TYPE_LATEST, text

    async def _state(self, headers: dict[str, str]) -> tuple[str, bytes]:
        reading = state.read(self.sources, self.events, self._started)
        if not self._admin(headers.get("authorization", "")):
            reading = state.redacted(reading)
        body = await asyncio.get_running_loop().run_in_executor(None, state.render, reading)
        return "application/json", body


    def _admin(self, authorization: str) -> bool:
        """Whether a request may see a shared service's tenants: it carries an admin's token
        (`Authorization: Bearer TOKEN`). Anyone may, on a server that is not shared."""
        shared = self.sources.head.shared
        if shared is None:
            return True
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        try:
            return bool(shared.tenants.authenticate("", token.strip()).admin)
        except errors.IsthmusError:
            return False


def _exposition(reading: Reading | None) -> bytes:
    """Prometheus text of a reading (on any thread)."""
    metrics = list(families(reading)) if reading is not None else []
    return generate_latest(Collected(metrics))
