"""The client port over HTTP/2 handled by `h2` on asyncio, instead of grpc.aio (the default;
`--client-transport grpc` keeps grpc.aio).

grpc.aio costs the server 110-130 µs of CPU per request and response before any isthmus code
runs (bench/RESULTS.md); the client's session stream is thousands of small messages a
second. Here the same gRPC methods (`Method` records, from the servicers) are served by a
small gRPC-over-HTTP/2 layer on h2 (python-hyper), one `h2connection.Connection` per client
connection. Only what the stock IFRT proxy client and isthmus's own workers use is served:
identity encoding, no compression. This module holds the listeners (a TCP port, a shared
service's gate and Unix socket) and the connections open on them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from isthmus.wire.h2connection import Connection
from isthmus.wire.h2frames import Wire
from isthmus.wire.methods import MAX_MESSAGE, Method

if TYPE_CHECKING:
    from isthmus.frontend.lease_service import Identity
    from isthmus.wire.gate import Gate, GatedListener
    from isthmus.wire.peers import Ticket

TRIM_AFTER = 1000  # connections open at once, past which their closing gives memory back


class H2Server:
    """Serves `methods` (by path, "/package.Service/Method") on a TCP port."""

    def __init__(self, methods: dict[str, Method], gate: Gate | None = None,
                 max_message: int = MAX_MESSAGE) -> None:
        self.methods = methods
        self.max_message = max_message  # bytes of one gRPC message (--max-message-bytes)
        # A shared service's `gate.Gate`: connections say who they are before HTTP/2.
        self.gate = gate
        self._server: asyncio.AbstractServer | None = None
        self._unix: asyncio.AbstractServer | None = None
        self._listener: GatedListener | None = None
        self._connections: set[Connection] = set()
        self._peak = 0  # connections open at once since memory was last given back
        self._trim: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        if self.gate is not None:
            from isthmus.wire.gate import GatedListener

            self._listener = GatedListener(self.gate, self._connected, self._identified)
            return self._listener.listen(host, port)
        self._server = await loop.create_server(self._connected, host.strip("[]"), port)
        return self._server.sockets[0].getsockname()[1]

    async def start_unix(self, path: str) -> None:
        """Also serves a Unix socket at `path` (only this user may connect: mode 0600): the
        client port of a machine where no TCP socket may be opened, or a shared service's
        tunnels, which need no TLS there."""
        import os

        from isthmus.wire.gate import Preamble

        gate = self.gate
        old = os.umask(0o177)
        try:
            self._unix = await asyncio.get_running_loop().create_unix_server(
                (lambda: Preamble(gate, self._identified, True, gate.peers.unix()))
                if gate is not None else self._connected, path)
        finally:
            os.umask(old)

    def _connected(self, ticket: Ticket | None = None) -> Wire:
        return self._identified(None, ticket)

    def _identified(self, identity: Identity | None, ticket: Ticket | None = None) -> Wire:
        connection = Connection(self.methods, self.max_message)
        connection.identity = identity
        connection.ticket = ticket
        self._connections.add(connection)
        self._peak = max(self._peak, len(self._connections))
        task = asyncio.get_running_loop().create_task(connection.run())
        task.add_done_callback(lambda _: self._ended(connection))
        return connection.wire

    def _ended(self, connection: Connection) -> None:
        self._connections.discard(connection)
        # After many connections closed (a flood from the service's own machine, say), what
        # they held goes back to the system, once they have stopped closing for a second.
        if self._peak >= TRIM_AFTER and len(self._connections) <= self._peak // 2:
            if self._trim is not None:
                self._trim.cancel()
            self._trim = asyncio.get_running_loop().call_later(1.0, self._give_back)

    def _give_back(self) -> None:
        from isthmus.gctune import give_back

        self._trim = None
        self._peak = len(self._connections)
        give_back()

    async def stop(self, grace: float | None = None) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._unix is not None:
            self._unix.close()
        if self._server is not None:
            self._server.close()
        if self._trim is not None:
            self._trim.cancel()
        for connection in list(self._connections):
            connection.close()
