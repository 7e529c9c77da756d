"""A gRPC method as both client-port transports serve it (`servicer.grpc_handlers`,
`h2server.H2Server`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Method:
    """One gRPC method: its shape, handler and (de)serializers (None: raw bytes)."""

    kind: str  # "unary_unary", "unary_stream", "stream_unary" or "stream_stream"
    fn: Callable[..., Any]
    deserialize: Callable[[bytes], Any] | None = None
    serialize: Callable[[Any], bytes] | None = None
