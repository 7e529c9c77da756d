"""The user's end of a shared service's tunnels: local Unix sockets whose connections reach
the service with the tenant's credentials (docs/shared.md, "How it works").

`Forwarder` runs an event loop in a thread of its own; `ForwarderProcess` runs one in a child
process, for a process that runs jax itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

logger = logging.getLogger(__name__)

PIPE_CHUNK = 1 << 20


class LeaseRefused(RuntimeError):
    """The service refused the lease (credentials, quota, capacity) or it ended; the message
    is one line naming the reason."""


class Forwarder:
    """Local Unix sockets whose connections are tunnelled to the service with the tenant's
    credentials (an HTTP CONNECT, over TLS unless the service is a Unix socket).

    Runs an event loop in a thread of its own; `listen(authority)` returns a socket path."""

    def __init__(self, service: str, token: str, ca: str | None = None, tenant: str = "",
                 timeout: float = 10.0) -> None:
        self.service = service
        self.credentials = base64.b64encode(f"{tenant}:{token}".encode()).decode()
        self.ca = ca
        self.timeout = timeout
        self.directory = tempfile.mkdtemp(prefix="isthmus-tunnel-")  # mode 0700
        self.loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="isthmus-forwarder",
                                        daemon=True)
        self._thread.start()
        self._tls: Any = None
        if not service.startswith("unix:"):
            from isthmus.transport.service_tls import client_context

            self._tls = client_context(ca)

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _open(self, authority: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A tunnel to the service for `authority`; LeaseRefused with the service's reason."""
        try:
            if self.service.startswith("unix:"):
                opening = asyncio.open_unix_connection(self.service.removeprefix("unix:"))
            else:
                host, _, port = self.service.rpartition(":")
                host = host.strip("[]")
                opening = asyncio.open_connection(host, int(port), ssl=self._tls,
                                                  server_hostname=host,
                                                  limit=PIPE_CHUNK)
            reader, writer = await asyncio.wait_for(opening, self.timeout)
        except (TimeoutError, OSError, ValueError) as e:
            raise LeaseRefused(f"cannot reach the service at {self.service}: "
                               f"{_reason(e)}") from None
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
                     f"Proxy-Authorization: Basic {self.credentials}\r\n\r\n".encode())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            writer.close()
            raise LeaseRefused(f"the service at {self.service} did not open a tunnel: "
                               f"{_reason(e)}") from None
        status = head.split(b"\r\n", 1)[0].split(b" ")
        if len(status) < 2 or status[1] != b"200":
            body = b""
            with contextlib.suppress(Exception):
                body = await asyncio.wait_for(reader.read(4096), 1.0)
            writer.close()
            raise LeaseRefused(body.decode(errors="replace").strip() or
                               f"the service refused the tunnel ({head[:80]!r})")
        return reader, writer

    def check(self) -> None:
        """Opens one control tunnel: LeaseRefused (e.g. a wrong token) before anything else."""
        async def probe() -> None:
            _, writer = await self._open("control")
            writer.close()
        self._run(probe(), self.timeout * 2)

    def listen(self, authority: str, name: str) -> str:
        """A Unix socket here whose connections tunnel to `authority`."""
        path = os.path.join(self.directory, f"{name}.sock")

        async def serve() -> None:
            self._servers.append(await asyncio.start_unix_server(
                lambda r, w: self._tunnel(r, w, authority), path, limit=PIPE_CHUNK))
        self._run(serve(), self.timeout)
        return path

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      authority: str) -> None:
        try:
            upstream_reader, upstream_writer = await self._open(authority)
        except LeaseRefused as e:
            logger.warning("isthmus: %s", e)
            print(f"isthmus: {e}", file=sys.stderr)
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, upstream_writer),
                                 _pipe(upstream_reader, writer))
        except asyncio.CancelledError:  # the forwarder closes
            writer.close()
            upstream_writer.close()

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            self._run(stop(), 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        shutil.rmtree(self.directory, ignore_errors=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(PIPE_CHUNK)
            if not data:
                break
            writer.write(data)
            if writer.transport.get_write_buffer_size() > PIPE_CHUNK:
                await writer.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class ForwarderProcess:
    """A `Forwarder` in a child process, for a process that runs jax itself: jax's client
    may hold the interpreter's lock while it waits for the server, and a forwarder in a
    thread of the same interpreter would then wait for it in turn. Same interface; the
    child exits when this process does (its stdin closes)."""

    def __init__(self, service: str, token: str, ca: str | None = None, tenant: str = "",
                 timeout: float = 10.0) -> None:
        import subprocess

        self.timeout = timeout
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from isthmus.forwarder import forwarder_main; "
             "forwarder_main()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._ask({"service": service, "token": token, "ca": ca, "tenant": tenant,
                   "timeout": timeout})

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except OSError:
            line = ""
        if not line:
            raise LeaseRefused("the forwarder process ended; see its output above.")
        answer = json.loads(line)
        if "error" in answer:
            raise LeaseRefused(answer["error"])
        return answer

    def check(self) -> None:
        self._ask({"op": "check"})

    def listen(self, authority: str, name: str) -> str:
        return str(self._ask({"op": "listen", "authority": authority, "name": name})["path"])

    def close(self) -> None:
        import subprocess

        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def forwarder_main() -> None:
    """The child of `ForwarderProcess`: a forwarder driven by JSON lines on stdin."""
    config = json.loads(sys.stdin.readline())
    try:
        forwarder = Forwarder(config["service"], config["token"], config["ca"],
                              config["tenant"], config["timeout"])
    except Exception as e:  # noqa: BLE001 - a bad CA file, say: said to the parent
        print(json.dumps({"error": f"cannot start the forwarder: {e}"}), flush=True)
        return
    print(json.dumps({"ok": True}), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            try:
                if command["op"] == "check":
                    forwarder.check()
                    answer: dict[str, Any] = {"ok": True}
                else:
                    answer = {"path": forwarder.listen(command["authority"], command["name"])}
            except LeaseRefused as e:
                answer = {"error": str(e)}
            print(json.dumps(answer), flush=True)
    finally:
        forwarder.close()


def _reason(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "no answer in time"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
