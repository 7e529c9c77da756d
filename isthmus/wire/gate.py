"""Who is on the line: the gate of a shared service's client port.

On a shared service (`isthmus up --tenants FILE`) every connection of the client port is
looked at before HTTP/2 starts, by its first byte:

- TLS (a handshake record, 0x16): decrypted with the service's certificate, then as below
  with credentials allowed;
- `CONNECT` (an HTTP/1.1 proxy request): the tunnel of a tenant's client. It must carry
  `Proxy-Authorization: Basic base64(tenant:token)`; its authority says what the tunnel is
  for: `control` (asking for leases), `lease/ID` (jax's connection under that lease), or
  anything else (the stock client's own `grpc_proxy` route: the tenant's one live lease).
  Allowed over TLS and on the Unix socket; in clear over TCP only with
  `--allow-plain-connect`, since it carries the token;
- `PRI` (HTTP/2 at once): a connection without identity, for the fleet's workers and
  `isthmus status`; IFRT calls on it are refused as unauthenticated.

Until a connection has said who it is it is a stranger, held to the per-peer limits of
`wire/peers.py`: closed after `auth_seconds`, a few open per peer, a few calls a second.

A refused tunnel gets one HTTP status line and one line of reason, and is closed; nothing is
left behind. After `200 Connection established` the bytes are HTTP/2, served by the same
`h2server` connection as any other, which carries the identity into every call's context.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import logging
import socket
import ssl
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from isthmus import errors
from isthmus.wire.peers import Limits, PeerBook, Ticket, is_local

if TYPE_CHECKING:
    from isthmus.frontend.lease_service import Identity
    from isthmus.wire.h2frames import Wire

    # (identity, ticket) -> a fresh h2server connection's `Wire`, once the connection has
    # said who it is; the ticket goes on with a connection that is still a stranger.
    Connect = Callable[[Identity | None, Ticket | None], Wire]

logger = logging.getLogger(__name__)

MAX_PREAMBLE = 8192  # bytes of a CONNECT request, headers included
ACCEPT_BATCH = 64  # connections taken from the listening socket in one turn at most
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
HOLD_SECONDS = 1.0  # a connection refused for its peer's limits is held unread this long
MAX_HELD = 1024  # ... and at most this many are held at once
TLS_RECORD = 0x16


class Gate:
    """Establishes identities for the connections of a shared service's client port.

    `authenticate(tenant, token, lease_id)` returns the identity or raises an
    `IsthmusError`; `lease_for(identity)` binds a tunnel without a lease id (the stock
    client's `grpc_proxy` route) to the tenant's one live lease."""

    def __init__(self, authenticate: Callable[[str, str, str | None], Identity],
                 lease_for: Callable[[Identity], Identity],
                 tls: ssl.SSLContext | None, allow_plain_connect: bool = False,
                 limits: Limits | None = None) -> None:
        self.authenticate = authenticate
        self.lease_for = lease_for
        self.tls = tls
        self.allow_plain_connect = allow_plain_connect
        self.refused = 0
        self.peers = PeerBook(limits or Limits())  # what strangers may cost, by peer

    def identify(self, head: bytes, secure: bool) -> Identity:
        """The identity a CONNECT request (`head`, up to its blank line) establishes."""
        if not secure and not self.allow_plain_connect:
            raise errors.Unauthenticated(
                "credentials in clear are refused here: connect over TLS (isthmus run "
                "--service and isthmus.shared.connect do) or through the service's Unix "
                "socket; the operator may allow it with --allow-plain-connect.")
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, authority, _version = lines[0].split(" ")
        except ValueError:
            raise errors.InvalidRequest("the CONNECT request line is malformed.") from None
        if method != "CONNECT":
            raise errors.InvalidRequest("only CONNECT is served before HTTP/2.")
        credentials = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "proxy-authorization":
                scheme, _, encoded = value.strip().partition(" ")
                if scheme.lower() == "basic":
                    try:
                        credentials = base64.b64decode(encoded.strip(), validate=True).decode()
                    except (binascii.Error, UnicodeDecodeError):
                        raise errors.Unauthenticated(
                            "the Proxy-Authorization header is not valid base64.") from None
        if credentials is None or ":" not in credentials:
            raise errors.Unauthenticated(
                "the tunnel carries no credentials (Proxy-Authorization: Basic "
                "tenant:token); connect with isthmus run --service --token-file FILE.")
        tenant, _, token = credentials.partition(":")
        if authority == "control":
            return self.authenticate(tenant, token, None)
        if authority.startswith("lease/"):
            return self.authenticate(tenant, token, authority.removeprefix("lease/"))
        return self.lease_for(self.authenticate(tenant, token, None))


class Preamble(asyncio.Protocol):
    """A connection of a shared service until it has said who it is; then HTTP/2."""

    def __init__(self, gate: Gate, connect: Connect, secure: bool, ticket: Ticket) -> None:
        self.gate = gate
        self.connect = connect
        self.secure = secure
        self.ticket = ticket  # until it says who it is
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        seconds = self.gate.peers.limits.auth_seconds
        self.ticket.watch(lambda: self._refuse(
            408, "Request Timeout", f"the connection did not say who it is within "
            f"{seconds:g} s."))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        buffer = self.buffer
        if buffer.startswith(b"PRI ") or (len(buffer) < 4 and b"PRI ".startswith(buffer)):
            if len(buffer) >= 4:
                self._switch(None, buffer)
            return
        if not (buffer.startswith(b"CONNECT ") or b"CONNECT ".startswith(buffer[:8])):
            self._refuse(400, "Bad Request", "this port serves gRPC (HTTP/2) and CONNECT.")
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_PREAMBLE:
                self._refuse(431, "Request Header Fields Too Large", "the CONNECT request "
                             "is too large.")
            return
        try:
            identity = self.gate.identify(buffer[:end], self.secure)
        except errors.IsthmusError as e:
            status = {errors.Code.UNAUTHENTICATED: (407, "Proxy Authentication Required"),
                      errors.Code.INVALID_ARGUMENT: (400, "Bad Request")}.get(
                e.code, (403, "Forbidden"))
            self._refuse(*status, e.message)
            return
        assert self.transport is not None  # since connection_made
        self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        self._switch(identity, buffer[end + 4:])

    def _switch(self, identity: Identity | None, rest: bytes) -> None:
        ticket: Ticket | None = self.ticket
        if identity is not None:
            self.ticket.release()  # a tenant's tunnel: no longer a stranger
            ticket = None
        wire = self.connect(identity, ticket)
        assert self.transport is not None  # since connection_made
        self.transport.set_protocol(wire)
        wire.connection_made(self.transport)
        view = memoryview(rest)
        while view:
            target = wire.get_buffer(len(view))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            wire.buffer_updated(n)
            view = view[n:]

    def _refuse(self, status: int, phrase: str, reason: str) -> None:
        self.gate.refused += 1
        logger.info("refused a connection: %s", reason)
        body = (reason.replace("\n", " ") + "\n").encode()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                                 % (status, phrase.encode(), len(body), body))
            self.transport.close()
        self.ticket.release()

    def connection_lost(self, exc: Exception | None) -> None:
        self.ticket.release()


class GatedListener:
    """Accepts TCP connections and sorts them by their first byte (module docstring)."""

    def __init__(self, gate: Gate, plain: Callable[[Ticket], asyncio.BaseProtocol],
                 connect: Connect) -> None:
        self.gate = gate
        self.plain = plain  # ticket -> the protocol of a connection without identity (HTTP/2)
        self.connect = connect
        self.sock: socket.socket | None = None
        self._bound = ""  # the address listened on ("": any of this machine's)
        self._sorting: set[asyncio.Task[None]] = set()
        # Refused connections held unread until their deadline (`_hold`), oldest first.
        self._held: collections.deque[tuple[float, socket.socket]] = collections.deque()
        self._sweeping: asyncio.TimerHandle | None = None

    def listen(self, host: str, port: int) -> int:
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=1024)
        self.sock.setblocking(False)
        address = str(self.sock.getsockname()[0])
        self._bound = "" if address in ("0.0.0.0", "::") else address
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)
        return int(self.sock.getsockname()[1])

    def _accept(self) -> None:
        """Takes what the listening socket holds, up to ACCEPT_BATCH connections a turn; a
        connection over its peer's limits is closed here, before a task or a handshake (a
        flood of them costs an accept and a close each)."""
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: wait a moment, not spin
                logger.warning("accepting a connection failed: %s", e)
                fileno = self.sock.fileno()
                loop.remove_reader(fileno)
                loop.call_later(0.1, self._resume, fileno)
                return
            peer = str(address[0])
            try:
                local = self._bound or str(conn.getsockname()[0])
            except OSError:
                conn.close()
                continue
            ticket = self.gate.peers.admit(peer, is_local(peer, local))
            if ticket is None:  # over its peer's limits
                self._hold(conn)
                continue
            conn.setblocking(False)
            task = loop.create_task(self._sort(conn, ticket))
            self._sorting.add(task)
            task.add_done_callback(self._sorting.discard)

    def _hold(self, conn: socket.socket) -> None:
        """A refused connection is held unread for HOLD_SECONDS, then reset (no FIN
        exchange, no TIME_WAIT): a flooder that waits for its answer waits that long, and
        one that does not pays a connection each time, not a handshake of ours. At most
        MAX_HELD are held (the oldest goes first)."""
        loop = asyncio.get_running_loop()
        self._held.append((loop.time() + HOLD_SECONDS, conn))
        if len(self._held) > MAX_HELD:
            _reset(self._held.popleft()[1])
        if self._sweeping is None:
            self._sweeping = loop.call_later(HOLD_SECONDS, self._sweep)

    def _sweep(self) -> None:
        self._sweeping = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._held and self._held[0][0] <= now:
            _reset(self._held.popleft()[1])
        if self._held:
            self._sweeping = loop.call_at(self._held[0][0], self._sweep)

    def _resume(self, fileno: int) -> None:
        if self.sock is not None and self.sock.fileno() == fileno:
            asyncio.get_running_loop().add_reader(fileno, self._accept)

    async def _sort(self, conn: socket.socket, ticket: Ticket) -> None:
        try:
            await self._route(conn, ticket)
        except BaseException:
            ticket.release()
            raise

    async def _route(self, conn: socket.socket, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        seconds = self.gate.peers.limits.auth_seconds

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(conn.fileno(), ready)
        try:
            await asyncio.wait_for(readable, seconds)
            first = conn.recv(1, socket.MSG_PEEK)
        except (TimeoutError, OSError):
            first = b""
        finally:
            loop.remove_reader(conn.fileno())
        if not first:
            ticket.release()
            conn.close()
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if first[0] == TLS_RECORD:
                if self.gate.tls is None:
                    ticket.release()
                    conn.close()
                    return
                await loop.connect_accepted_socket(
                    lambda: Preamble(self.gate, self.connect, True, ticket), conn,
                    ssl=self.gate.tls, ssl_handshake_timeout=seconds)
            elif first == b"C":
                await loop.connect_accepted_socket(
                    lambda: Preamble(self.gate, self.connect, False, ticket), conn)
            else:
                await loop.connect_accepted_socket(lambda: self.plain(ticket), conn)
        except (TimeoutError, OSError, ssl.SSLError) as e:
            logger.info("a connection failed before it said who it is: %s", e)
            ticket.release()
            conn.close()

    def close(self) -> None:
        for task in list(self._sorting):
            task.cancel()
        if self._sweeping is not None:
            self._sweeping.cancel()
        while self._held:
            _reset(self._held.popleft()[1])
        if self.sock is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # the loop is closed already
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None


def _reset(conn: socket.socket) -> None:
    """Closes with a reset: no FIN exchange, no TIME_WAIT."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
    conn.close()
