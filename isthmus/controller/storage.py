"""Each tenant's files in its own place: client-named locations inside the tenant's root.

On a shared service every location a client names (a checkpoint's save or restore, a
profile's trace directory) is resolved against its tenant's `storage_root` (the tenants
file's) before any worker sees it:

    root "/data/alice"          "ckpt/7"                  -> /data/alice/ckpt/7
                                "/data/alice/ckpt/7"      -> /data/alice/ckpt/7
                                "file:///data/alice/x"    -> /data/alice/x
                                "../bob/ckpt", "/data/bob", "gs://b/x", "ftp://h/x" -> refused
    root "gs://bucket/alice"    "ckpt/7"                  -> gs://bucket/alice/ckpt/7
                                "gs://bucket/alice/x"     -> gs://bucket/alice/x
                                "gs://bucket/bob/x", "gs://other/alice", "/tmp/x" -> refused

Names are normalized first (`..` and `.` segments, repeated '/'), so an escape is refused
whatever its spelling. The result names the root's own scheme and host only: nothing
connects to a host a tenant names. A session that is not a shared service's has no
`TenantFiles` and its locations are used as given.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath

from isthmus import errors

logger = logging.getLogger(__name__)

# fsspec reads these as more than a path: "::" chains filesystems (a second URL inside the
# name), and a NUL ends a path early in the OS.
_NEVER = ("::", "\x00")


@dataclasses.dataclass(frozen=True, slots=True)
class TenantFiles:
    """What a shared service's session may do with files and profiles."""

    tenant: str  # the tenant's name, for messages
    root: str | None  # its storage root (absolute local directory or fsspec URL); None: none
    tenants_file: str  # the tenants file's path, for messages
    lease: str  # the lease whose workers its profiles cover (one profile per lease at a time)
    max_profile_seconds: float  # a profile stops by itself after this long (the service's cap)

    def resolve(self, location: str, what: str) -> str:
        """`location` inside the tenant's root; `NotPermitted` when it has none or the
        location lies outside it. `what` names the use ("a checkpoint", "a profile")."""
        if self.root is None:
            raise errors.NotPermitted(
                f"tenant {self.tenant} has no storage root on this service, so it cannot "
                f"write or read {what}; the operator gives it one with storage_root = "
                f"\"/DIR\" (or an fsspec URL such as \"gs://BUCKET/{self.tenant}\") in its "
                f"[tenants.{self.tenant}] table of {self.tenants_file or 'the tenants file'}.")
        return resolve(self.root, location, what)


def resolve(root: str, location: str, what: str = "files") -> str:
    """`location` (a client's) inside `root` (an absolute normalized local directory, or an
    fsspec URL without a trailing '/'), normalized; `NotPermitted` naming the root when it
    lies outside (an escape with `..`, another directory, another scheme or host)."""
    if any(bad in location for bad in _NEVER) or not location.strip():
        raise _outside(root, location, what)
    scheme, path = _split(root)
    given_scheme, given = _split(location.strip())
    if given_scheme is None:  # a path: relative ones join the root
        if scheme is not None and given.startswith("/"):
            raise _outside(root, location, what)
        joined = posixpath.normpath(posixpath.join(path, given))
    elif given_scheme == (scheme or "file"):
        joined = posixpath.normpath(given if scheme is None else given.lstrip("/"))
    else:
        raise _outside(root, location, what)
    if scheme is None:
        joined = "/" + joined.lstrip("/")  # POSIX keeps a leading "//": one is the root
        inside = joined == path or joined.startswith(path.rstrip("/") + "/")
        if inside:
            return joined
    else:
        base = path.strip("/")
        inside = joined == base or joined.startswith(base + "/")
        if inside and not joined.startswith(("..", "/")):
            return f"{scheme}://{joined}"
    raise _outside(root, location, what)


def _split(location: str) -> tuple[str | None, str]:
    """(scheme, rest) of a URL, or (None, path)."""
    if "://" in location:
        scheme, _, rest = location.partition("://")
        return scheme.lower(), rest
    return None, location


def _outside(root: str, location: str, what: str) -> errors.NotPermitted:
    return errors.NotPermitted(
        f"{what} at {location[:200]!r} lies outside this tenant's storage root {root}; name "
        "a location relative to the root (or a path inside it).")
