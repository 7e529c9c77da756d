"""Who may use a shared service: the tenants file (`isthmus up --tenants FILE`).

The file is TOML, one table per tenant, plus service-wide settings:

    grace_seconds = 60                 # a disconnected lease is kept this long
    fresh_workers = "colocated"        # after which leases a slice gets fresh worker processes:
                                       #   "colocated" (its tenant may run colocated Python) or
                                       #   "always"
    admins = ["ops"]                   # tenants that may list and revoke leases
    max_profile_seconds = 60           # a tenant's profile stops by itself after this long
    max_upload_bytes = 4294967296      # default of each tenant's (below)
    max_requests_per_second = 10000    # default of each tenant's (below)

    [tenants.alice]
    token_file = "alice.token"         # relative to this file; or token_sha256 = "<hex>"
    max_slices = 2                     # quota: slices held at once, over all leases
    priority = 10                      # higher is served first (default 0)
    max_lease_seconds = 86400          # a lease ends this long after its grant (default: none)
    storage_root = "/data/alice"       # where its checkpoints and profiles go (or an fsspec URL)
    colocated_python = false           # may run colocated Python on its workers (default: no)
    max_upload_bytes = 1073741824      # bytes of uploaded host buffers held, not yet used
    max_requests_per_second = 500      # its sessions' requests, together (its flood waits)

Tokens are compared by their SHA-256, in constant time; the file never needs to hold one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import stat
import tomllib
from collections.abc import Mapping
from typing import TypeGuard

from isthmus import errors

DEFAULT_GRACE_SECONDS = 60.0
MAX_TOKEN_BYTES = 4096  # a token file longer than this is not a token
DEFAULT_MAX_PROFILE_SECONDS = 60.0
DEFAULT_MAX_UPLOAD_BYTES = 4 << 30
DEFAULT_MAX_REQUESTS_PER_SECOND = 10000.0
# A tenant's limits: each a field of its table, its default a setting of the file's top.
LIMITS = ("max_upload_bytes", "max_requests_per_second")
NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    """One user or team of a shared service."""

    name: str
    token_sha256: bytes = dataclasses.field(repr=False)  # digest of its secret token
    max_slices: int  # slices it may hold at once, over all its leases
    priority: int = 0  # higher first in the queue; may reclaim slices of lower elastic leases
    max_lease_seconds: float | None = None  # a lease ends this long after its grant
    admin: bool = False  # may list every lease and the queue, and revoke
    storage_root: str | None = None  # its files' place: an absolute local directory or an
    #   fsspec URL; None: it may not persist or profile
    colocated_python: bool = False  # may run colocated Python (in its lease's sandboxed workers)
    # Bytes its sessions' uploaded host buffers hold before a request takes them; one more
    # upload is refused (RESOURCE_EXHAUSTED).
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    # Requests a second of its sessions together; beyond, its sessions' reading waits.
    max_requests_per_second: float = DEFAULT_MAX_REQUESTS_PER_SECOND


@dataclasses.dataclass(frozen=True, slots=True)
class Tenants:
    """The parsed tenants file."""

    by_name: Mapping[str, Tenant]
    grace_seconds: float = DEFAULT_GRACE_SECONDS  # a lease without its client is kept this long
    path: str = ""  # where it was read from
    fresh_workers: str = "colocated"  # "colocated" or "always": which ended leases renew workers
    max_profile_seconds: float = DEFAULT_MAX_PROFILE_SECONDS  # a tenant's profile stops then

    def authenticate(self, name: str, token: str) -> Tenant:
        """The tenant `name` if `token` is its secret; `Unauthenticated` otherwise (the same
        message whether the name or the token is wrong)."""
        digest = hashlib.sha256(token.encode()).digest()
        if not name:  # the token alone names its tenant (tokens are unique)
            name = next((t.name for t in self.by_name.values()
                         if hmac.compare_digest(t.token_sha256, digest)), "")
        tenant = self.by_name.get(name)
        expected = tenant.token_sha256 if tenant is not None else bytes(32)
        if not hmac.compare_digest(digest, expected) or tenant is None or not token:
            raise errors.Unauthenticated(
                f"tenant {name!r} with this token is not known to the service; check "
                "--token-file (and the tenant name) with the service's operator.")
        return tenant


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token, for `token_sha256` in a tenants file."""
    return hashlib.sha256(token.strip().encode()).hexdigest()


def read_file(path: str, what: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path` (`what` names it in errors: "the token file");
    ValueError naming it when it cannot be read, is not a regular file or is over `limit`
    bytes. A FIFO is refused, not read: reading one waits, silently, for a writer."""
    try:  # O_NONBLOCK: opening a FIFO does not wait for its writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ValueError(f"{what} {path} is {kind}, not a regular file; give a file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:
            raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if limit is not None and len(data) > limit:
        raise ValueError(f"{what} {path} is longer than {limit} bytes; a token is a short "
                         "secret (e.g. `openssl rand -hex 32 > FILE`)")
    return data


def decode(data: bytes, path: str, what: str) -> str:
    """`data` of the file `path` as UTF-8; ValueError naming the file and the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as "
                         "UTF-8") from None


def read_token(path: str, what: str = "the token file") -> str:
    """A token from its file (surrounding whitespace dropped); ValueError naming the file."""
    token = decode(read_file(path, what, MAX_TOKEN_BYTES), path, what).strip()
    if not token:
        raise ValueError(f"{what} {path} is empty; put the secret in it (e.g. "
                         "`openssl rand -hex 32 > FILE`)")
    return token


def load(path: str) -> Tenants:
    """Reads a tenants file; ValueError with one line naming the file, table and field."""
    text = decode(read_file(path, "the tenants file"), path, "the tenants file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"the tenants file {path} is not TOML: {e}") from None
    return parse(data, os.path.dirname(os.path.abspath(path)), path)


def parse(data: Mapping[str, object], directory: str = ".", path: str = "tenants") -> Tenants:
    unknown = set(data) - {"tenants", "admins", "grace_seconds", "fresh_workers",
                           "max_profile_seconds", *LIMITS}
    if unknown:
        raise ValueError(f"{path}: unknown settings {sorted(unknown)}; a tenants file has "
                         "[tenants.NAME] tables, admins, grace_seconds, fresh_workers, "
                         "max_profile_seconds, max_upload_bytes and max_requests_per_second")
    tables = data.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{path}: no [tenants.NAME] table; add one per user or team")
    admins = data.get("admins", [])
    if not isinstance(admins, list) or not all(isinstance(a, str) for a in admins):
        raise ValueError(f"{path}: admins must be a list of tenant names")
    missing = sorted(set(admins) - set(tables))
    if missing:
        raise ValueError(f"{path}: admins {missing} have no [tenants.NAME] table")
    grace = data.get("grace_seconds", DEFAULT_GRACE_SECONDS)
    if not isinstance(grace, (int, float)) or isinstance(grace, bool) or not grace >= 0 or (
            grace == math.inf):
        raise ValueError(f"{path}: grace_seconds must be a number of seconds >= 0")
    fresh = data.get("fresh_workers", "colocated")
    if not isinstance(fresh, str) or fresh not in ("colocated", "always"):
        raise ValueError(f"{path}: fresh_workers must be \"colocated\" or \"always\"")
    profile = data.get("max_profile_seconds", DEFAULT_MAX_PROFILE_SECONDS)
    if not isinstance(profile, (int, float)) or isinstance(profile, bool) or not (
            0 < profile < math.inf):
        raise ValueError(f"{path}: max_profile_seconds must be a number of seconds > 0")
    by_name = {name: _limited(_tenant(name, table, directory, path, name in admins), table,
                              data, path)
               for name, table in tables.items()}
    digests = [t.token_sha256 for t in by_name.values()]
    if len(set(digests)) != len(digests):
        raise ValueError(f"{path}: two tenants share a token; give each its own")
    return Tenants(by_name, float(grace), path, fresh, float(profile))


def _tenant(name: str, table: object, directory: str, path: str, admin: bool) -> Tenant:
    where = f"{path}: [tenants.{name}]"
    if not name or not set(name) <= NAME_CHARACTERS:
        raise ValueError(f"{where}: a tenant name is letters, digits, '_', '.' and '-'")
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    known = {"token_file", "token_sha256", "max_slices", "priority", "max_lease_seconds",
             "storage_root", "colocated_python", *LIMITS}
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} (known: {sorted(known)})")
    if ("token_file" in table) == ("token_sha256" in table):
        raise ValueError(f"{where}: give exactly one of token_file and token_sha256")
    if "token_file" in table:
        token_path = os.path.join(directory, str(table["token_file"]))
        digest = hashlib.sha256(read_token(token_path).encode()).digest()
    else:
        try:
            digest = bytes.fromhex(str(table["token_sha256"]))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: token_sha256 must be 64 hex digits "
                             "(the SHA-256 of the token: `tr -d '\\n' < FILE | sha256sum`)")
    max_slices = table.get("max_slices")
    if not _is_int(max_slices) or max_slices < 0:
        raise ValueError(f"{where}: max_slices must be a whole number >= 0")
    priority = table.get("priority", 0)
    if not _is_int(priority):
        raise ValueError(f"{where}: priority must be a whole number")
    seconds = table.get("max_lease_seconds")
    if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(
            seconds, bool) or not seconds > 0):
        raise ValueError(f"{where}: max_lease_seconds must be a number of seconds > 0")
    colocated = table.get("colocated_python", False)
    if not isinstance(colocated, bool):
        raise ValueError(f"{where}: colocated_python must be true or false")
    return Tenant(name, digest, max_slices, priority,
                  None if seconds is None else float(seconds), admin,
                  _storage_root(table.get("storage_root"), directory, where), colocated)


def _limited(tenant: Tenant, table: Mapping[str, object], top: Mapping[str, object],
             path: str) -> Tenant:
    """`tenant` with its limits: its table's, else the file's defaults (`LIMITS`)."""
    where = f"{path}: [tenants.{tenant.name}]"
    upload = table.get("max_upload_bytes", top.get("max_upload_bytes",
                                                   DEFAULT_MAX_UPLOAD_BYTES))
    if not _is_int(upload) or upload < 0:
        raise ValueError(f"{where}: max_upload_bytes must be a whole number of bytes >= 0")
    rate = table.get("max_requests_per_second", top.get("max_requests_per_second",
                                                        DEFAULT_MAX_REQUESTS_PER_SECOND))
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate < math.inf:
        raise ValueError(f"{where}: max_requests_per_second must be a number > 0")
    return dataclasses.replace(tenant, max_upload_bytes=upload,
                               max_requests_per_second=float(rate))


def _storage_root(value: object, directory: str, where: str) -> str | None:
    """A tenant's storage root: a local directory (relative to the tenants file, made absolute
    and normalized) or an fsspec URL (`gs://bucket/alice`), kept without a trailing '/'."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: storage_root must be a directory or an fsspec URL")
    if "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme == "file":
            value = rest
        else:
            if not rest.strip("/"):
                raise ValueError(f"{where}: storage_root {value!r} names no bucket or path")
            return value.rstrip("/")
    return os.path.normpath(os.path.join(directory, os.path.expanduser(value)))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
