"""Message classes for the IFRT proxy protocol, taken from the installed jaxlib.

jaxlib links the IFRT proxy client into ``libjax_common.so`` together with the serialized
``FileDescriptorProto`` of every .proto file it uses. Each one starts with the bytes
``0x0a, len(name), name`` (field 1, the file name). We find those, let protobuf's own parser
read them, and build a private descriptor pool from them: the server then matches the
installed client field for field, with no hand-written .proto that could drift.

The recovered descriptors are cached on disk, keyed by the library's path, size and mtime, so
that only the first start after installing a jaxlib pays for the scan.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pathlib
import threading
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from isthmus.protocol.wireformat import read_varint

logger = logging.getLogger(__name__)

# The roots we need; their dependencies are followed transitively.
_ROOT_FILES = (
    "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto",
    "xla/python/ifrt_proxy/common/ifrt_service.proto",
    "xla/python/ifrt_proxy/common/array_util.proto",
    "xla/python/ifrt/sharding_serdes.proto",
    "xla/python/pjrt_ifrt/xla_sharding.proto",
    "xla/python/pjrt_ifrt/xla_compiler.proto",
    "xla/python/pjrt_ifrt/pjrt_layout_serdes.proto",
    "xla/python/ifrt/layout_serdes.proto",
    "xla/python/ifrt/custom_call_program.proto",
    "xla/pjrt/proto/compile_options.proto",
)
# Files whose absence is tolerated (present in some jaxlib versions only).
_OPTIONAL_FILES: frozenset[str] = frozenset()

_CACHE_VERSION = b"1"


class SchemaError(RuntimeError):
    """The installed jaxlib does not carry the descriptors the server needs."""


def _library_path() -> pathlib.Path:
    import jaxlib  # deferred: only the server needs jaxlib's files

    path = pathlib.Path(jaxlib.__file__).parent / "libjax_common.so"
    if not path.exists():
        raise SchemaError(
            f"{path} not found: isthmus reads the IFRT proxy schema from jaxlib's shared "
            f"library; install a jaxlib wheel from PyPI ({_supported_jaxlib()})."
        )
    return path


def _supported_jaxlib() -> str:
    """The jaxlib requirement isthmus was installed with (its package metadata), so that the
    message follows pyproject.toml instead of going stale."""
    from importlib import metadata

    try:
        for requirement in metadata.requires("isthmus") or ():
            if requirement.replace(" ", "").startswith("jaxlib") and "extra" not in requirement:
                return requirement.replace(" ", "")
    except metadata.PackageNotFoundError:
        pass
    return "the jaxlib range of isthmus's pyproject.toml"


# FileDescriptorProto field number -> allowed wire types.
_FILE_FIELDS = {1: {2}, 2: {2}, 3: {2}, 4: {2}, 5: {2}, 6: {2}, 7: {2}, 8: {2}, 9: {2},
                10: {0, 2}, 11: {0, 2}, 12: {2}, 14: {0}, 15: {2}}


def _descriptor_extent(buf: Any, start: int, end: int) -> int:
    """Returns where a serialized FileDescriptorProto starting at `start` ends.

    Walks fields while they are valid FileDescriptorProto fields; the first byte that is not
    (a zero byte, the next descriptor's second `name`) ends it.
    """
    pos = start
    seen_name = False
    while pos < end:
        try:
            tag, nxt = read_varint(buf, pos, end)
            field, wire_type = tag >> 3, tag & 7
            if wire_type not in _FILE_FIELDS.get(field, ()):
                break
            if field == 1:
                if seen_name:
                    break
                seen_name = True
            if wire_type == 2:
                length, nxt = read_varint(buf, nxt, end)
                nxt += length
                if nxt > end:
                    break
            else:
                _, nxt = read_varint(buf, nxt, end)
        except ValueError:
            break
        pos = nxt
    return pos


def _find_file(buf: Any, name: str) -> descriptor_pb2.FileDescriptorProto | None:
    encoded = name.encode()
    needle = b"\x0a" + bytes([len(encoded)]) + encoded
    best: descriptor_pb2.FileDescriptorProto | None = None
    pos = buf.find(needle)
    while pos >= 0:
        extent = _descriptor_extent(buf, pos, len(buf))
        try:
            proto = descriptor_pb2.FileDescriptorProto.FromString(bytes(buf[pos:extent]))
        except Exception:  # noqa: BLE001 - a string that only looks like a descriptor
            proto = None
        if proto is not None and proto.name == name and (
            best is None or proto.ByteSize() > best.ByteSize()
        ):
            best = proto
        pos = buf.find(needle, pos + 1)
    return best


def _builtin_file(name: str) -> descriptor_pb2.FileDescriptorProto | None:
    """google/protobuf/*.proto come from the protobuf package itself."""
    if not name.startswith("google/protobuf/"):
        return None
    module = name[len("google/protobuf/"):-len(".proto")] + "_pb2"
    try:
        mod = __import__(f"google.protobuf.{module}", fromlist=["DESCRIPTOR"])
    except ImportError:
        return None
    proto = descriptor_pb2.FileDescriptorProto()
    mod.DESCRIPTOR.CopyToProto(proto)
    return proto


def _extract(library: pathlib.Path) -> descriptor_pb2.FileDescriptorSet:
    result = descriptor_pb2.FileDescriptorSet()
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        seen: set[str] = set()
        order: list[descriptor_pb2.FileDescriptorProto] = []

        def visit(name: str) -> None:
            if name in seen:
                return
            seen.add(name)
            proto = _builtin_file(name) or _find_file(buf, name)
            if proto is None:
                if name in _OPTIONAL_FILES:
                    return
                raise SchemaError(
                    f"descriptor for {name} not found in {library}; this jaxlib build is not "
                    "supported by isthmus (see the README for the tested versions)."
                )
            for dep in proto.dependency:
                visit(dep)
            order.append(proto)

        for root in _ROOT_FILES:
            visit(root)
    result.file.extend(order)
    return result


def _cache_path(library: pathlib.Path) -> pathlib.Path:
    stat = library.stat()
    key = hashlib.sha256(
        b"|".join([_CACHE_VERSION, str(library).encode(), str(stat.st_size).encode(),
                   str(stat.st_mtime_ns).encode(), "|".join(_ROOT_FILES).encode()])
    ).hexdigest()[:24]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "isthmus" / f"ifrt-schema-{key}.pb"


def load_file_set() -> descriptor_pb2.FileDescriptorSet:
    """The descriptors of the installed jaxlib, from the cache or freshly extracted."""
    library = _library_path()
    cache = _cache_path(library)
    try:
        return descriptor_pb2.FileDescriptorSet.FromString(cache.read_bytes())
    except (OSError, Exception):  # noqa: BLE001 - a missing or corrupt cache is rebuilt
        pass
    file_set = _extract(library)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(file_set.SerializeToString())
        os.replace(tmp, cache)
    except OSError as e:
        logger.debug("could not cache the IFRT schema at %s: %s", cache, e)
    return file_set


class Schema:
    """Message classes by full name, e.g. ``schema["xla.ifrt.proxy.IfrtRequest"]``."""

    def __init__(self, file_set: descriptor_pb2.FileDescriptorSet) -> None:
        self._pool = descriptor_pool.DescriptorPool()
        for proto in file_set.file:
            self._pool.Add(proto)
        # Built at runtime from the schema: the type checker cannot see their methods.
        self._classes: dict[str, Any] = {}

    def __getitem__(self, full_name: str) -> Any:
        cls = self._classes.get(full_name)
        if cls is None:
            descriptor = self._pool.FindMessageTypeByName(full_name)
            cls = message_factory.GetMessageClass(descriptor)
            self._classes[full_name] = cls
        return cls

    def has(self, full_name: str) -> bool:
        try:
            self._pool.FindMessageTypeByName(full_name)
        except KeyError:
            return False
        return True

    def enum_value(self, enum_full_name: str, value_name: str) -> int:
        return self._pool.FindEnumTypeByName(enum_full_name).values_by_name[value_name].number


_lock = threading.Lock()
_schema: Schema | None = None


def schema() -> Schema:
    """The process-wide schema of the installed jaxlib (loaded once, on first use)."""
    global _schema
    with _lock:
        if _schema is None:
            _schema = Schema(load_file_set())
        return _schema
