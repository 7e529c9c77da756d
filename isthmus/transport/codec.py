"""The fleet's wire format: msgpack, with an extension per type the fleet carries.

Decoding builds only what is registered here: message records (`messages`), the records a
reply may carry (compiled-program descriptions, dtypes), isthmus's errors, numpy arrays,
slices, ranges and frozensets. Nothing in a frame can name a class or a function to call, so
decoding a frame from a stranger cannot run its code (pickle could). Tuples and lists both
arrive as tuples.
"""

from __future__ import annotations

import dataclasses
import struct
import types
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgpack
import numpy as np

from isthmus import dtypes, errors

if TYPE_CHECKING:
    from collections.abc import Buffer

    from _typeshed import DataclassInstance

_RECORD, _FROZENSET, _RANGE, _SLICE, _ARRAY, _OBJECTS, _ERROR, _DTYPE, _BULK = range(1, 10)
_SPAN = struct.Struct("<QQ")  # a bulk value's offset in its frame's tail, and its length
BULK_ALIGNMENT = 64  # what jaxlib wants of host memory it adopts without a copy


_R = TypeVar("_R")  # a record class

class Bulk:
    """Bytes that travel beside the encoded message instead of inside it (`encode_parts`):
    neither end copies them to encode or decode. They arrive as a memoryview of the frame."""

    __slots__ = ("view",)

    def __init__(self, data: Buffer) -> None:
        self.view = memoryview(data).cast("B")

    def __len__(self) -> int:
        return len(self.view)


class CodecError(ValueError):
    """A value of a type the fleet does not carry, or a frame that does not decode."""


class _Tag:
    """What an extension marker decodes to: it heads the array that carries the value."""

    __slots__ = ("code", "name")

    def __init__(self, code: int, name: str) -> None:
        self.code = code
        self.name = name


class Codec:
    """Encodes and decodes the registered records and the values listed above.

    A value of an extended type travels as a msgpack array headed by a small extension
    marker (`[marker, *fields]`), so the fields are packed and unpacked by msgpack's own C
    code; the marker says what to build from them.
    """

    def __init__(self) -> None:
        # Records travel under their class name (both ends may register in another order).
        self._records: dict[str, type] = {}
        self._fields: dict[type, tuple[msgpack.ExtType, tuple[str, ...]]] = {}
        self._errors: dict[str, type[errors.IsthmusError]] = {}
        # What each marker decodes to: one per record, one per other extension.
        self._tags: dict[tuple[int, bytes], _Tag] = {
            (code, b""): _Tag(code, "") for code in range(_FROZENSET, _DTYPE + 1)}
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True)
        self._markers = {code: msgpack.ExtType(code, b"") for code in (
            _FROZENSET, _RANGE, _SLICE, _ARRAY, _OBJECTS, _ERROR, _DTYPE)}
        # While encode_parts packs: the bulk views so far, and their total length; while
        # decode reads a frame with a tail: that tail.
        self._tails: list[memoryview] | None = None
        self._tail_bytes = 0
        self._tail: memoryview | None = None

    def record(self, cls: type[_R]) -> type[_R]:
        """Registers a dataclass (a decorator); its fields travel in declaration order."""
        name = cls.__name__
        if self._records.get(name, cls) is not cls:
            raise ValueError(f"two records named {name} in the fleet's codec")
        self._records[name] = cls
        fields = dataclasses.fields(cast("type[DataclassInstance]", cls))  # what it takes
        self._fields[cls] = (msgpack.ExtType(_RECORD, name.encode()),
                             tuple(f.name for f in fields))
        self._tags[(_RECORD, name.encode())] = _Tag(_RECORD, name)
        return cls

    def error(self, cls: type[errors.IsthmusError]) -> None:
        self._errors[cls.__name__] = cls

    def encode(self, value: object) -> bytes:
        """`value` packed whole (`Bulk` bytes inside it are copied in)."""
        return self._packer.pack(value)

    def encode_parts(self, value: object) -> tuple[bytes, list[memoryview]]:
        """`value` packed, but for its `Bulk` bytes, which are returned beside it in order:
        the message and then those views, end to end, are what `decode` takes back."""
        self._tails, self._tail_bytes = [], 0
        try:
            return self._packer.pack(value), self._tails
        finally:
            self._tails = None

    def decode(self, data: bytes | memoryview, tail: memoryview | None = None) -> Any:
        """The value packed in `data`; `tail`: the bytes `encode_parts` put beside it."""
        self._tail = tail
        try:
            return msgpack.unpackb(data, ext_hook=self._ext, list_hook=self._build,
                                   use_list=False, raw=False, strict_map_key=False)
        except CodecError:
            raise
        except Exception as e:  # noqa: BLE001 - msgpack's own errors, a short frame
            raise CodecError(f"the frame does not decode ({type(e).__name__}: {e})") from None
        finally:
            self._tail = None

    def _default(self, value: Any) -> object:
        kind = type(value)
        described = self._fields.get(kind)
        if described is not None:
            marker, fields = described
            return (marker, *[getattr(value, field) for field in fields])
        markers = self._markers
        if kind is Bulk:
            if self._tails is None:
                return value.view.tobytes()
            pad = -self._tail_bytes % BULK_ALIGNMENT
            if pad:  # each bulk value starts aligned in the receiver's tail buffer
                self._tails.append(memoryview(bytes(pad)))
                self._tail_bytes += pad
            span = msgpack.ExtType(_BULK, _SPAN.pack(self._tail_bytes, len(value.view)))
            self._tails.append(value.view)
            self._tail_bytes += len(value.view)
            return span
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                return (markers[_OBJECTS], value.shape, value.ravel().tolist())
            return (markers[_ARRAY], value.dtype.name, value.shape,
                    np.ascontiguousarray(value).tobytes())
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, (frozenset, set)):
            return (markers[_FROZENSET], *value)
        if isinstance(value, range):
            return (markers[_RANGE], value.start, value.stop, value.step)
        if isinstance(value, slice):
            return (markers[_SLICE], value.start, value.stop, value.step)
        if isinstance(value, errors.IsthmusError):
            return (markers[_ERROR], type(value).__name__, value.message, int(value.code))
        if isinstance(value, dtypes.DType):
            return (markers[_DTYPE], value.kind)
        raise CodecError(f"the fleet does not carry values of type {kind.__qualname__}")

    def _ext(self, code: int, data: bytes) -> memoryview | _Tag:
        if code == _BULK:
            offset, length = _SPAN.unpack(data)
            if self._tail is None or offset + length > len(self._tail):
                raise CodecError("a frame's bulk bytes are missing")
            return self._tail[offset:offset + length]
        tag = self._tags.get((code, data))
        if tag is not None:
            return tag
        if code == _RECORD:
            raise CodecError(f"a frame names {data.decode(errors='replace')!r}, which is no "
                             "record of the fleet")
        raise CodecError(f"unknown extension {code} in a frame")

    def _build(self, items: tuple[Any, ...]) -> object:
        if not items or type(head := items[0]) is not _Tag:
            return items
        code, rest = head.code, items[1:]
        if code == _RECORD:
            return self._records[head.name](*rest)
        if code == _FROZENSET:
            return frozenset(rest)
        if code == _RANGE:
            return range(*rest)
        if code == _SLICE:
            return slice(*rest)
        if code == _ARRAY:
            import ml_dtypes

            dtype, shape, raw = rest
            kind = np.dtype(getattr(ml_dtypes, dtype, dtype))
            return np.frombuffer(raw, kind).reshape(shape).copy()
        if code == _OBJECTS:
            shape, values = rest
            out = np.empty(len(values), dtype=object)
            out[:] = list(values)
            return out.reshape(shape)
        if code == _ERROR:
            name, message, status = rest
            error = self._errors.get(name, errors.IsthmusError)(message)
            if int(error.code) != status:
                error.code = errors.Code(status)
            return error
        return dtypes.BY_KIND[rest[0]]  # _DTYPE


def register_errors(codec: Codec, module: types.ModuleType = errors) -> None:
    """Registers every IsthmusError class of `module` (others arrive as IsthmusError, with
    their message and status code)."""
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, errors.IsthmusError):
            codec.error(value)
