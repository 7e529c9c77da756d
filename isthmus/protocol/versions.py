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


# What the stock client of each jaxlib offers in its GetVersion request, measured: IFRT
# SerDes (min, max) -> jaxlib (min 0: the field is not sent). Protocol versions are 16..25
# for the first three, 16..28 for 0.12.1.
CLIENT_SERDES = {(0, 3): "0.10.x", (0, 6): "0.11.x", (2, 6): "0.12.0", (3, 7): "0.12.1"}


def client_jaxlib(serdes_min: int, serdes_max: int) -> str:
    """The jaxlib a stock client's version request identifies, as words for messages."""
    known = CLIENT_SERDES.get((serdes_min, serdes_max))
    if known is not None:
        return f"jaxlib {known}"
    if serdes_max > max(high for _, high in CLIENT_SERDES):
        return f"a jaxlib newer than 0.12 (IFRT SerDes {serdes_min}..{serdes_max})"
    return f"a jaxlib isthmus does not know (IFRT SerDes {serdes_min}..{serdes_max})"


def server_jaxlib() -> str:
    import jaxlib.version

    return jaxlib.version.__version__


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
    serdes_high = min(client_serdes or MAX_SERDES_VERSION, MAX_SERDES_VERSION)
    serdes_low = max(client_serdes_min or 0, MIN_SERDES_VERSION)
    if low > high or serdes_low > serdes_high:
        client = client_jaxlib(client_serdes_min or 0, client_serdes)
        raise errors.VersionMismatch(
            f"the client ({client}; IFRT proxy protocol {client_min}..{client_max}, SerDes "
            f"{client_serdes_min or 0}..{client_serdes}) cannot work with this isthmus server "
            f"(jaxlib {server_jaxlib()}; protocol {MIN_PROTOCOL_VERSION}.."
            f"{MAX_PROTOCOL_VERSION}, SerDes {MIN_SERDES_VERSION}..{MAX_SERDES_VERSION}). "
            "Use a client jax between 0.10 and 0.12 (see 'Supported versions' in the README).")
    return Version(high, serdes_high)
