"""Workers and controller prove to each other that they know the fleet's token.

Every control stream starts with a handshake, before either end decodes a single message
(a stranger is never even parsed; the codec could not run its code anyway). Both ends send a
fresh random nonce; each answers with an HMAC-SHA256, keyed by the token, of both nonces and
its role, and checks the other's answer in constant time. A worker learns that the controller
knows the token before it trusts anything the controller says, and the controller learns the
same of the worker before it takes it into the fleet. Nobody sends the token itself.

A fleet without a token uses the empty one: every member agrees, so it runs as before, on a
network it must trust (`isthmus up` warns when it listens beyond this machine without one; a
shared service refuses to, and makes a token of its own for the workers it launches).

*Single-use join tokens.* A shared service hands each worker it launches a token of its own
(`JoinTokens.issue`), good for one handshake: the worker's stream starts with `MAGIC_JOIN` and
the token's public id, the controller proves and checks with that token and then forgets it.
What the worker's memory or environment holds afterwards (where a tenant's code runs) opens
nothing. A worker that must join again is started afresh, with a new token.

Peer data requests (`isthmus.WorkerData/Fetch`) carry an HMAC of the buffer they ask for,
keyed by the serving worker's data key of this membership (`Welcome.data_key`, random); only
the controller, which knows every worker's key, makes them (`Pull.mac`). A worker thus fetches
the buffers it was told to, and nothing else, whatever its memory holds.

This authenticates; it does not encrypt. On a network others can watch, run the fleet inside
a private network or a VPN.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import Protocol

TOKEN_ENVIRONMENT = "ISTHMUS_FLEET_TOKEN"  # where workers (and `isthmus up`) may find it
MAGIC = b"isthmus-fleet/1\n"  # what a worker's stream starts with
MAGIC_JOIN = b"isthmus-join/v1\n"  # ... with a single-use join token (then its id)
JOIN_PREFIX = "isthmus-join:"  # a join token is JOIN_PREFIX + id + ":" + secret
JOIN_ID_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 10.0  # seconds an end waits for the other's part of the handshake


class Reader(Protocol):
    """The end of a stream the handshake reads (`frames.FrameStream`, asyncio's reader)."""

    async def readexactly(self, n: int) -> bytes: ...


class Writer(Protocol):
    """The end of a stream the handshake writes."""

    def write(self, data: bytes) -> None: ...


class Unauthenticated(ConnectionError):
    """The other end does not know the fleet's token (or does not speak the handshake)."""


def _mac(token: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, role + b"".join(parts), hashlib.sha256).digest()


async def _read(reader: Reader, n: int) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), HANDSHAKE_TIMEOUT)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
        raise Unauthenticated("the other end closed or stalled during the handshake") from None


class JoinTokens:
    """The single-use join tokens a controller has issued and not yet seen used."""

    def __init__(self) -> None:
        self._pending: dict[bytes, str] = {}  # public id -> the whole token

    def issue(self) -> str:
        ident = secrets.token_bytes(JOIN_ID_BYTES)
        token = f"{JOIN_PREFIX}{ident.hex()}:{secrets.token_hex(32)}"
        self._pending[ident] = token
        return token

    def take(self, ident: bytes) -> str | None:
        """The token of `ident`, forgotten from now on; None if unknown or used."""
        return self._pending.pop(ident, None)

    def __len__(self) -> int:
        return len(self._pending)


def is_join_token(token: str) -> bool:
    return token.startswith(JOIN_PREFIX)


async def prove_worker(reader: Reader, writer: Writer, token: str) -> None:
    """The worker's side: raises Unauthenticated unless the controller knows `token`."""
    key = token.encode()
    mine = secrets.token_bytes(NONCE_BYTES)
    if is_join_token(token):
        ident = bytes.fromhex(token[len(JOIN_PREFIX):].partition(":")[0])
        writer.write(MAGIC_JOIN + ident + mine)
    else:
        writer.write(MAGIC + mine)
    answer = await _read(reader, NONCE_BYTES + MAC_BYTES)
    theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"controller", mine, theirs)):
        raise Unauthenticated(
            "the controller does not know this worker's fleet token; give both the same "
            "--token-file (or ISTHMUS_FLEET_TOKEN)")
    writer.write(_mac(key, b"worker", theirs, mine))


async def check_worker(reader: Reader, writer: Writer, token: str,
                       joins: JoinTokens | None = None) -> None:
    """The controller's side: raises Unauthenticated unless the worker knows `token`, or a
    join token of `joins` (which is then used up, whether the worker proves it or not)."""
    hello = await _read(reader, len(MAGIC) + NONCE_BYTES)
    if hello.startswith(MAGIC_JOIN):
        rest = hello[len(MAGIC_JOIN):] + await _read(reader, JOIN_ID_BYTES)
        ident, theirs = rest[:JOIN_ID_BYTES], rest[JOIN_ID_BYTES:]
        joined = joins.take(ident) if joins is not None else None
        if joined is None:
            raise Unauthenticated("a join token that this controller never issued, or one "
                                  "used already (a worker that joins again is started afresh)")
        key = joined.encode()
    elif hello.startswith(MAGIC):
        theirs = hello[len(MAGIC):]
        key = token.encode()
    else:
        raise Unauthenticated("the stream did not start with the fleet handshake")
    mine = secrets.token_bytes(NONCE_BYTES)
    writer.write(mine + _mac(key, b"controller", theirs, mine))
    proof = await _read(reader, MAC_BYTES)
    if not hmac.compare_digest(proof, _mac(key, b"worker", mine, theirs)):
        raise Unauthenticated("wrong or missing fleet token")


def fetch_mac(token: str, buffer_id: int) -> bytes:
    """What a peer data request for `buffer_id` carries."""
    return _mac(token.encode(), b"fetch", str(buffer_id).encode())


def fetch_allowed(token: str, buffer_id: int, mac: bytes) -> bool:
    return hmac.compare_digest(mac, fetch_mac(token, buffer_id))
