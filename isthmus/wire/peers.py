"""What a connection without identity may cost a shared service: the per-peer limits of its
client port (`wire/gate.py`).

A connection is a *stranger* from its accept until it says who it is: a tenant's tunnel
(CONNECT with credentials), or a fleet worker's pulse that the controller recognizes
(`isthmus.Fleet/Alive`). Until then it holds a `Ticket`:

- it is closed `auth_seconds` after it opened (idle HTTP/2 prefaces, half-sent CONNECTs,
  stalled TLS handshakes alike);
- its peer (the source address; an IPv6 one by its /64) holds at most `peer_connections`
  of them at once: one more is closed at accept, before any TLS handshake;
- its peer's new connections and calls together come at most `peer_requests` a second
  (a token bucket holding one second's worth): one more is refused, and its connection
  closed.

Connections from the service's own machine (the source address is the address the
connection reached, or the Unix socket) are not counted against a peer: the service's own
workers and `isthmus status` come from there, and a stranger elsewhere must not starve them.
The deadline holds for them too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

MAX_PEERS = 10000  # peers remembered before the idle ones are forgotten


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The client port's limits on connections without identity (`isthmus up` flags)."""

    auth_seconds: float = 5.0  # a connection must say who it is this soon (--auth-timeout)
    peer_connections: int = 16  # such connections open at once per peer (--peer-connections)
    peer_requests: float = 20.0  # their new connections and calls a second, per peer
    #   (--peer-requests)


class _Peer:
    __slots__ = ("open", "tokens", "at")

    def __init__(self, tokens: float, now: float) -> None:
        self.open = 0  # its connections without identity
        self.tokens = tokens  # what its bucket holds (one second's worth when full)
        self.at = now  # when `tokens` was last brought up to date


class Ticket:
    """One connection without identity: counted against its peer until `release` (it said
    who it is, or it closed)."""

    __slots__ = ("book", "peer", "local", "opened", "_timer")

    def __init__(self, book: PeerBook, peer: _Peer | None, local: bool) -> None:
        self.book = book
        self.peer = peer  # None: not counted (this machine)
        self.local = local  # from the service's own machine
        self.opened = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, expire: Callable[[], None]) -> None:
        """Calls `expire` (which closes the connection) `auth_seconds` after it opened,
        unless it is released first."""
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, self.opened + self.book.limits.auth_seconds - time.monotonic())
        self._timer = loop.call_later(delay, self._expired, expire)

    def _expired(self, expire: Callable[[], None]) -> None:
        self._timer = None
        self.book.expired += 1
        expire()

    def spend(self) -> bool:
        """One call on this connection: False when its peer is over `peer_requests`."""
        return self.peer is None or self.book.take(self.peer)

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.peer is not None:
            self.peer.open -= 1
            self.peer = None


class PeerBook:
    """The strangers of one client port, by peer."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._peers: dict[str, _Peer] = {}
        self.refused = 0  # connections and calls refused for their peer's limits
        self.expired = 0  # connections closed for not saying who they are in time

    def admit(self, peer: str, local: bool) -> Ticket | None:
        """A new connection from `peer` (its address) without identity; None: refused."""
        if local:
            return Ticket(self, None, True)
        key = _key(peer)
        now = time.monotonic()
        state = self._peers.get(key)
        if state is None:
            if len(self._peers) >= MAX_PEERS:
                self._forget(now)
            state = self._peers[key] = _Peer(self._capacity(), now)
        if state.open >= self.limits.peer_connections or not self.take(state):
            self.refused += 1
            logger.debug("refused a connection from %s: over its peer's limits", peer)
            return None
        state.open += 1
        return Ticket(self, state, False)

    def unix(self) -> Ticket:
        """A connection of the Unix socket (this machine)."""
        return Ticket(self, None, True)

    def take(self, state: _Peer) -> bool:
        now = time.monotonic()
        state.tokens = min(self._capacity(),
                           state.tokens + (now - state.at) * self.limits.peer_requests)
        state.at = now
        if state.tokens < 1.0:
            self.refused += 1
            return False
        state.tokens -= 1.0
        return True

    def _capacity(self) -> float:
        return max(1.0, self.limits.peer_requests)

    def _forget(self, now: float) -> None:
        """Drops the peers with nothing open whose bucket would be full again."""
        refill = self._capacity() / max(self.limits.peer_requests, 1e-9)
        for key in [k for k, p in self._peers.items() if not p.open and now - p.at > refill]:
            del self._peers[key]


def is_local(peer: str, local: str) -> bool:
    """A TCP connection from this machine: it comes from the address it reached."""
    return bool(peer) and peer == local


def _key(peer: str) -> str:
    """A peer's address; an IPv6 address by its /64 (one host usually holds a whole one)."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)
