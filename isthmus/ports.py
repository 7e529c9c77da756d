"""A TCP port nobody listens on yet, for a listener started next (the collective group's
coordinator, a Slurm controller, a test's server); and whether this machine lets a process
open a TCP socket at all (a TPU sandbox does not)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has free on `host` now (IPv6 when `host` has a colon). Another process
    may take it before the caller binds it: callers that cannot retry bind at once."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_available() -> bool:
    """Whether this process may open a TCP socket on the loopback (some sandboxes refuse
    every internet socket: then a local fleet runs over Unix sockets)."""
    try:
        with socket.socket(socket.AF_INET) as s:
            s.bind(("127.0.0.1", 0))
    except OSError:
        return False
    return True
