"""Protocol version negotiation.

The client sends the range of IFRT proxy protocol versions it speaks; the server answers the
highest version both sides support. Answering a version outside the client's range aborts the
client process, so a request with no common version gets an error instead.
"""

from __future__ import annotations

import dataclasses

from isthmus import errors

# Versions this server implements (see docs/protocol.md for what each adds).
MIN_PROTOCOL_VERSION = 16
MAX_PROTOCOL_VERSION = 25
# The IFRT SerDes version of the serialized programs, shardings and layouts we exchange.
MIN_SERDES_VERSION = 3
MAX_SERDES_VERSION = 3

# Protocol versions at which behaviour changes (names follow XLA's VERSION.md).
VERSION_COST_ANALYSIS = 18  # LoadedExecutableCostAnalysis / HumanReadableProgramText


@dataclasses.dataclass(frozen=True, slots=True)
class Version:
    protocol: int
    serdes: int


def negotiate(client_min: int, client_max: int, client_serdes: int,
              client_serdes_min: int | None = None) -> Version:
    """The version to speak with a client offering [client_min, client_max]."""
    if client_max <= 0:
        raise errors.VersionMismatch(
            "the client sent no protocol version range; use a jaxlib with the IFRT proxy "
            f"client (isthmus speaks protocol versions {MIN_PROTOCOL_VERSION}.."
            f"{MAX_PROTOCOL_VERSION}).")
    low = max(client_min, MIN_PROTOCOL_VERSION)
    high = min(client_max, MAX_PROTOCOL_VERSION)
    if low > high:
        raise errors.VersionMismatch(
            f"the client speaks IFRT proxy protocol versions {client_min}..{client_max}, "
            f"isthmus speaks {MIN_PROTOCOL_VERSION}..{MAX_PROTOCOL_VERSION}: no common "
            "version. Install a jax/jaxlib in the supported range (see the README).")
    serdes_high = min(client_serdes or MAX_SERDES_VERSION, MAX_SERDES_VERSION)
    serdes_low = max(client_serdes_min or 0, MIN_SERDES_VERSION)
    if serdes_low > serdes_high:
        raise errors.VersionMismatch(
            f"the client uses IFRT SerDes version {client_serdes}, isthmus supports "
            f"{MIN_SERDES_VERSION}..{MAX_SERDES_VERSION}; install a jax/jaxlib in the "
            "supported range (see the README).")
    return Version(high, serdes_high)
