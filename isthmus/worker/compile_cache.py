"""A compilation cache that outlives the server: compiled executables in a directory (or any
fsspec URL), so that a program compiled before a restart is loaded, not compiled, after it.

Each host keeps the executables it compiled for its own devices. An entry's key is a SHA-256
of everything that decides what XLA builds: the program without its debug information
(source locations, as jax's own cache does: an edited script still hits), the vetted compile
options,
the program's devices (global ids, and this client's ids, processes and kinds), this host's
place in its collective group, the platform and its version, and the jaxlib version.

- *Safe to share between servers.* An entry is written under a temporary name and renamed
  into place (atomic on a local file system; a single object write on object stores), so a
  reader sees a whole entry or none.
- *Never a crash.* An entry starts with a magic line and the SHA-256 of its payload; one that
  is truncated, corrupted, or that this jaxlib cannot load is removed and compiled again.
- *Bounded.* Past `max_bytes`, the least recently used entries go (a hit refreshes an
  entry's time where the store allows; on object stores, the time of writing counts).
- *Trusted.* Loading an entry runs the machine code in it: a cache shared by several users
  is code execution for every reader. Give each tenant its own `namespace` (a subdirectory),
  and let only the server write the location.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from isthmus.compat.jaxlib_types import (
    CompileOptions,
    DeviceList,
    JaxlibClient,
    JaxlibDevice,
    LoadedExecutable,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger(__name__)

FORMAT = b"isthmus-xla-executable 1\n"
SUFFIX = ".xla"


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """Where compiled executables persist (`--compile-cache`)."""

    location: str  # a directory or an fsspec URL (gs://..., s3://...)
    namespace: str = "default"  # one per tenant: entries of other namespaces are never read
    max_bytes: int = 4 << 30  # least recently used entries go past this

    def __post_init__(self) -> None:
        if not self.location:
            raise ValueError("--compile-cache needs a directory or a URL")
        if not self.namespace or "/" in self.namespace or self.namespace.startswith("."):
            raise ValueError(f"--compile-cache-namespace must be a plain name, not "
                             f"{self.namespace!r}")
        if self.max_bytes <= 0:
            raise ValueError("--compile-cache-size must be positive")


class CompileCache:
    """The persistent executables of one host."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._fs, root = filesystem(config.location)
        self._dir = f"{root.rstrip('/')}/{config.namespace}"
        self._fs.makedirs(self._dir, exist_ok=True)
        self._lock = threading.Lock()  # eviction scans one at a time
        self.hits = self.misses = self.rejected = 0

    # ---- keys ----------------------------------------------------------------------------

    @staticmethod
    def key(client: JaxlibClient, devices: Sequence[JaxlibDevice], program_digest: bytes,
            compile_options: bytes, device_ids: Sequence[int], replicas: int,
            namespace: str = "") -> str:
        """`program_digest`: the program's SHA-256 without debug information
        (`programs.canonical_digest`)."""
        import jaxlib

        digest = hashlib.sha256(FORMAT)
        for part in (jaxlib.__version__, getattr(client, "platform", ""),
                     getattr(client, "platform_version", ""), client.process_index(),
                     len(client.devices()), tuple(device_ids), replicas,
                     tuple((d.id, d.process_index, d.device_kind) for d in devices)):
            digest.update(repr(part).encode() + b"\0")
        digest.update(program_digest)
        digest.update(hashlib.sha256(compile_options).digest())
        if namespace:  # a shared service's tenant: entries apart from other tenants'
            digest.update(b"namespace\0" + namespace.encode())
        return digest.hexdigest()

    @staticmethod
    def program_digest(module: bytes, known: bytes = b"") -> bytes:
        """What names a program in a key: its SHA-256 without debug information, so that an
        edited script still hits (`programs.canonical_digest`, which parses the program,
        unless the vetting process's digest is `known`)."""
        from isthmus.worker.programs import canonical_digest

        return known or canonical_digest(module)

    def _path(self, key: str) -> str:
        return f"{self._dir}/{key}{SUFFIX}"

    # ---- entries -------------------------------------------------------------------------

    def load(self, key: str, client: JaxlibClient, devices: DeviceList,
             options: CompileOptions) -> LoadedExecutable | None:
        """The executable stored under `key`, loaded on `client`; None when there is none
        usable (a bad entry is removed)."""
        path = self._path(key)
        try:
            with self._fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as e:
            logger.warning("compile cache: cannot read %s (%s); compiling", path, e)
            self.misses += 1
            return None
        payload = _payload(data)
        executable = None
        if payload is not None:
            try:
                executable = client.deserialize_executable(payload, devices, options)
            except Exception as e:  # noqa: BLE001 - another jaxlib's entry, a bad payload
                logger.warning("compile cache: %s does not load (%s); compiling again",
                               path, str(e).splitlines()[0][:200] if str(e) else e)
        if executable is None:
            self.rejected += 1
            self._remove(path)
            return None
        self.hits += 1
        try:
            self._fs.touch(path, truncate=False)  # recently used
        except Exception:  # noqa: BLE001 - stores without modification times
            pass
        return executable

    def store(self, key: str, client: JaxlibClient, executable: LoadedExecutable,
              payload: bytes = b"") -> None:
        """Writes an executable, or its `payload` when it came serialized (an executable
        loaded from bytes does not serialize whole again); errors are logged: the cache is
        an optimisation."""
        try:
            payload = payload or client.serialize_executable(executable)
        except Exception as e:  # noqa: BLE001 - a backend that cannot serialize
            logger.info("compile cache: this executable cannot be serialized (%s)", e)
            return
        path = self._path(key)
        try:
            write_whole(self._fs, path, FORMAT + hashlib.sha256(payload).digest() + payload)
        except OSError as e:
            logger.warning("compile cache: cannot write %s (%s)", path, e)
            return
        self._evict()

    def _remove(self, path: str) -> None:
        try:
            self._fs.rm_file(path)
        except (FileNotFoundError, OSError):
            pass

    def _evict(self) -> None:
        with self._lock:
            try:
                entries = [e for e in self._fs.ls(self._dir, detail=True)
                           if e["name"].endswith(SUFFIX)]
            except OSError:
                return
            total = sum(int(e.get("size") or 0) for e in entries)
            if total <= self.config.max_bytes:
                return
            entries.sort(key=_modified)
            for entry in entries:
                if total <= self.config.max_bytes * 0.9:
                    break
                self._remove(entry["name"])
                total -= int(entry.get("size") or 0)

    def stats(self) -> dict[str, int]:
        return {"compile_cache_hits": self.hits, "compile_cache_misses": self.misses,
                "compile_cache_rejected": self.rejected}


class KeptExecutables:
    """The executables a worker compiled, serialized and kept in its memory for the life of
    the process, in front of the persistent cache (when there is one).

    A collective group that re-forms makes every program load again on its new client. With
    the same members as a group before it (a slice lost a second time, a slice back), a
    program's key is the same as it was then (`CompileCache.key`), and it is loaded from
    here in a tenth of its compile time. Entries are serialized and written (here, and to
    the persistent cache below when there is one) after the compile is answered, in a
    thread of their own: a large program's serialization, hash and write took 20-50 ms of
    its compile's answer on a TPU v5e. `flush` waits for them (a worker does as it stops).
    Past `max_bytes`, the least recently used go.
    """

    key = staticmethod(CompileCache.key)

    def program_digest(self, module: bytes, known: bytes = b"") -> bytes:
        """The persistent cache's name of a program when there is one below; else the bytes'
        SHA-256, which is enough in memory (one controller sends a program's bytes alike)
        and costs no parse."""
        if self.below is not None:
            return self.below.program_digest(module, known)
        return hashlib.sha256(module).digest()

    def __init__(self, below: CompileCache | None = None,
                 max_bytes: int = 512 << 20) -> None:
        import collections
        import concurrent.futures

        self.below = below
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="isthmus-keep")
        self.hits = self.misses = 0

    def load(self, key: str, client: JaxlibClient, devices: DeviceList,
             options: CompileOptions) -> LoadedExecutable | None:
        with self._lock:
            payload = self._entries.get(key)
            if payload is not None:
                self._entries.move_to_end(key)
        if payload is not None:
            try:
                executable = client.deserialize_executable(payload, devices, options)
            except Exception as e:  # noqa: BLE001 - compiled again instead
                logger.warning("a kept executable does not load (%s); compiling again",
                               str(e).splitlines()[0][:200] if str(e) else e)
                self._drop(key)
            else:
                self.hits += 1
                return executable
        self.misses += 1
        return self.below.load(key, client, devices, options) if self.below else None

    def store(self, key: str, client: JaxlibClient, executable: LoadedExecutable,
              payload: bytes = b"") -> None:
        # One serialization for both, after the answer.
        self._writer.submit(self._keep, key, client, executable, payload, self.below)

    def _keep(self, key: str, client: JaxlibClient, executable: LoadedExecutable, payload: bytes,
              below: CompileCache | None) -> None:
        try:
            payload = payload or client.serialize_executable(executable)
        except Exception as e:  # noqa: BLE001 - a backend that cannot serialize
            logger.info("this executable cannot be serialized (%s); not kept", e)
            return
        if below is not None:
            below.store(key, client, executable, payload)
        if len(payload) > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._size += len(payload) - (len(old) if old is not None else 0)
            self._entries[key] = payload
            while self._size > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._size -= len(dropped)

    def _drop(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= len(old)

    def flush(self, timeout: float = 30.0) -> None:
        """Waits for the writes queued so far (a stopping worker; tests)."""
        self._writer.submit(lambda: None).result(timeout)

    def stats(self) -> dict[str, int]:
        stats = self.below.stats() if self.below is not None else {}
        return {**stats, "kept_executable_hits": self.hits,
                "kept_executable_bytes": self._size}


def write_whole(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Writes `data` at `path` whole or not at all, for readers that may come at any time:
    under a temporary name renamed into place on a local file system, one object write on
    an object store. Raises OSError (the temporary file is gone)."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    temporary = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with fs.open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except OSError:
        try:
            fs.rm_file(temporary)
        except (FileNotFoundError, OSError):
            pass
        raise


def parse_size(text: str, option: str) -> int:
    """Bytes from "4G", "512M", "100k" or a plain number."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = value[-1:] if value[-1:] in units and not value[-1:].isdigit() else ""
    try:
        number = float(value[:len(value) - len(unit)])
    except ValueError:
        raise ValueError(f"{option} must be a size such as 512M or 4G, not {text!r}") from None
    if number <= 0:
        raise ValueError(f"{option} must be positive, not {text!r}")
    return int(number * units[unit])


def _payload(data: bytes) -> bytes | None:
    """The serialized executable of an entry, or None when the entry is damaged."""
    head = len(FORMAT) + 32
    if len(data) < head or not data.startswith(FORMAT):
        return None
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(FORMAT):head]:
        return None
    return payload


def _modified(entry: dict[str, Any]) -> float:  # an fsspec listing's entry
    value = entry.get("mtime") or entry.get("LastModified") or entry.get("updated") or 0
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def filesystem(location: str) -> tuple[AbstractFileSystem, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(location)
    except (ImportError, ValueError) as e:
        raise ValueError(f"--compile-cache {location}: {e} (install the fsspec backend for "
                         "that URL, e.g. gcsfs for gs://)") from None
    return fs, root


def is_local(fs: AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
