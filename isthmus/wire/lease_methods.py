"""`isthmus.Shared`: the gRPC methods of a shared service's leases (JSON in, JSON out).

They are served on the client port, and only to connections that said who they are (a
tunnel through the gate, `wire/gate.py`): `Lease` streams a client's lease from its request
to its end, `Release` ends one, and for admins `Leases` lists leases and the queue and
`Revoke` ends one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Coroutine

import grpc

from isthmus import errors
from isthmus.controller.leases import Listing
from isthmus.frontend.lease_service import Identity, SharedService
from isthmus.wire.methods import Method, Refused

SHARED_SERVICE = "isthmus.Shared"


def _refused(e: errors.IsthmusError) -> Refused:
    return Refused(grpc.StatusCode[e.code.name], e.message)


def _parse(request: bytes) -> dict[str, object]:
    try:
        parsed = json.loads(bytes(request) or b"{}")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python goes
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      "the request is not JSON (or is nested too deeply)") from None
    if not isinstance(parsed, dict):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a JSON object")
    return parsed


def _identity(context: object) -> Identity:
    identity = getattr(context, "identity", None)
    if not isinstance(identity, Identity):
        raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                      "leases are asked for through a tunnel with a tenant's credentials; "
                      "use isthmus run --service or isthmus.shared.connect.")
    return identity


def methods(shared: SharedService) -> dict[str, Method]:
    """The methods by path, for `start_server`'s `extra_methods`."""

    async def lease(request: bytes, context: object) -> AsyncIterator[bytes]:
        identity = _identity(context)
        ask = _parse(request)
        try:
            async for update in shared.lease_updates(identity, ask):
                yield json.dumps(update).encode()
        except errors.IsthmusError as e:
            raise _refused(e) from None

    def unary(answer: Callable[[Identity, dict[str, object]], object]
              ) -> Callable[[bytes, object], Coroutine[object, object, bytes]]:
        async def call(request: bytes, context: object) -> bytes:
            identity = _identity(context)
            body = _parse(request)
            try:
                return json.dumps(answer(identity, body)).encode()
            except errors.IsthmusError as e:
                raise _refused(e) from None
        call.__name__ = answer.__name__
        return call

    def release(identity: Identity, body: dict[str, object]) -> dict[str, str]:
        return shared.release(identity, str(body.get("lease", "")))

    def leases(identity: Identity, body: dict[str, object]) -> Listing:
        return shared.leases(identity)

    def revoke(identity: Identity, body: dict[str, object]) -> dict[str, str]:
        return shared.revoke(identity, str(body.get("lease", "")))

    prefix = f"/{SHARED_SERVICE}/"
    return {prefix + "Lease": Method("unary_stream", lease),
            prefix + "Release": Method("unary_unary", unary(release)),
            prefix + "Leases": Method("unary_unary", unary(leases)),
            prefix + "Revoke": Method("unary_unary", unary(revoke))}
