"""A small HTTP/1.1 server for GET (and HEAD) only, on the server's event loop.

Each route is a function of the request's headers (lower-case names) that returns (content
type, body), or an awaitable of them; it runs on the loop's thread, between the server's
other work, so what it reads is consistent (it may hand the writing-out to a thread). One
request per connection (`Connection: close`): the view polls once a second and Prometheus
scrapes every few, so keeping connections would buy nothing. Every read and write has a deadline.

On a loopback address, requests must name a loopback host (`Host:`), so that a web page
elsewhere cannot reach the port through a DNS name that points at 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

Route = Callable[[dict[str, str]], "tuple[str, bytes] | Awaitable[tuple[str, bytes]]"]
IO_TIMEOUT = 10.0  # seconds a client has to send its request, or to take the answer
MAX_HEAD = 16384  # bytes of request line and headers


class WebServer:
    """Serves `routes` (path -> Route) until `stop`."""

    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        self.port = 0
        self._server: asyncio.Server | None = None
        self._loopback = False
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        self._loopback = _is_loopback(host)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        try:
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        except TimeoutError:
            pass
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        self._writers.add(writer)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ConnectionError):
                return
            status, headers, body, method = await self._answer(head)
            lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers),
                     f"Content-Length: {len(body)}", "Connection: close",
                     "Cache-Control: no-store", "X-Content-Type-Options: nosniff", "", ""]
            writer.write("\r\n".join(lines).encode("latin-1"))
            if method != "HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), IO_TIMEOUT)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes, str]:
        """(status, headers, body, method) for a request head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _text("400 Bad Request", "a GET request line was expected\n") + ("GET",)
        method, target = parts[0], parts[1]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if self._loopback and not _loopback_name(headers.get("host", "")):
            return _text("403 Forbidden", "this port answers requests for a loopback "
                         "address only (Host: 127.0.0.1, [::1] or localhost)\n") + (method,)
        if method not in ("GET", "HEAD"):
            status, heads, body = _text("405 Method Not Allowed", "GET or HEAD only\n")
            return status, [*heads, ("Allow", "GET, HEAD")], body, method
        route = self.routes.get(target.split("?", 1)[0])
        if route is None:
            return _text("404 Not Found", f"no page at {target[:200]}; try /, /metrics or "
                         "/api/state\n") + (method,)
        try:
            answer = route(headers)
            if inspect.isawaitable(answer):
                answer = await answer
            content_type, body = answer
        except Exception:
            logger.exception("the observer's page %s failed", target[:200])
            return _text("500 Internal Server Error", "this page failed; the server's log "
                         "says why\n") + (method,)
        return "200 OK", [("Content-Type", content_type)], body, method


def _text(status: str, message: str) -> tuple[str, list[tuple[str, str]], bytes]:
    return status, [("Content-Type", "text/plain; charset=utf-8")], message.encode()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_name(host_header: str) -> bool:
    """The Host header names this machine's loopback (with or without a port)."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return _is_loopback(host.lower())
