"""Workers and controller prove to each other that they know the fleet's token.

Every control stream starts with a handshake, before either end decodes a single message
(a stranger is never even parsed; the codec could not run its code anyway). Both ends send a
fresh random nonce; each answers with an HMAC-SHA256, keyed by the token, of both nonces and
its role, and checks the other's answer in constant time. A worker learns that the controller
knows the token before it trusts anything the controller says, and the controller learns the
same of the worker before it takes it into the fleet. Nobody sends the token itself.

A fleet without a token uses the empty one: every member agrees, so it runs as before, on a
network it must trust (`isthmus up` warns when it listens beyond this machine without one).
Peer data requests (`isthmus.WorkerData/Fetch`) carry an HMAC of the buffer they ask for.

This authenticates; it does not encrypt. On a network others can watch, run the fleet inside
a private network or a VPN.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import Any

TOKEN_ENVIRONMENT = "ISTHMUS_FLEET_TOKEN"  # where workers (and `isthmus up`) may find it
MAGIC = b"isthmus-fleet/1\n"  # what a worker's stream starts with
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 10.0  # seconds an end waits for the other's part of the handshake


class Unauthenticated(ConnectionError):
    """The other end does not know the fleet's token (or does not speak the handshake)."""


def _mac(token: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, role + b"".join(parts), hashlib.sha256).digest()


async def _read(reader: Any, n: int) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), HANDSHAKE_TIMEOUT)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
        raise Unauthenticated("the other end closed or stalled during the handshake") from None


async def prove_worker(reader: Any, writer: Any,
                       token: str) -> None:
    """The worker's side: raises Unauthenticated unless the controller knows `token`."""
    key = token.encode()
    mine = secrets.token_bytes(NONCE_BYTES)
    writer.write(MAGIC + mine)
    answer = await _read(reader, NONCE_BYTES + MAC_BYTES)
    theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"controller", mine, theirs)):
        raise Unauthenticated(
            "the controller does not know this worker's fleet token; give both the same "
            "--token-file (or ISTHMUS_FLEET_TOKEN)")
    writer.write(_mac(key, b"worker", theirs, mine))


async def check_worker(reader: Any, writer: Any,
                       token: str) -> None:
    """The controller's side: raises Unauthenticated unless the worker knows `token`."""
    key = token.encode()
    hello = await _read(reader, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise Unauthenticated("the stream did not start with the fleet handshake")
    theirs = hello[len(MAGIC):]
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
