"""A TCP port nobody listens on yet, for a listener started next (the collective group's
coordinator, a Slurm controller, a test's server)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has free on `host` now (IPv6 when `host` has a colon). Another process
    may take it before the caller binds it: callers that cannot retry bind at once."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
