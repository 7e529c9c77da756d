"""Host data in and out: MakeArrayFromHostBuffer, MakeArraysFromHostBufferShards,
CopyToHostBuffer.

Host buffers hold the minimal memory region of a possibly strided array (`byte_strides`),
or for string arrays a serialized `StringArrayContents`. Every shape and stride is checked
against the buffer's actual size before any byte is read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from isthmus import dtypes, errors
from isthmus.controller.arrays import Array
from isthmus.controller.sharding import Sharding, shard_boxes, shard_shape
from isthmus.frontend.layouts import check_upload_layout
from isthmus.frontend.message import Message
from isthmus.frontend.serdes import ArraySpec, HostShardSpec
from isthmus.frontend.session import FrontendSession
from isthmus.hostmem import byte_view
from isthmus.ids import HostBufferHandle

logger = logging.getLogger(__name__)


def decode_host_array(session: FrontendSession, data: memoryview, dtype: dtypes.DType,
                      shape: tuple[int, ...], byte_strides: tuple[int, ...] | None
                      ) -> np.ndarray:
    """A numpy view of host buffer bytes (no copy for numeric data)."""
    count = math.prod(shape)
    if dtype.is_string:
        contents = session.schema["xla.ifrt.proto.StringArrayContents"]()
        try:
            contents.ParseFromString(data)
        except Exception:  # noqa: BLE001
            raise errors.InvalidRequest(
                "a string array's host buffer is not a StringArrayContents message.") from None
        if len(contents.strings) != count:
            raise errors.InvalidRequest(
                f"a string array of shape {shape} needs {count} strings, the host buffer has "
                f"{len(contents.strings)}.")
        value = np.empty(count, dtype=object)
        value[:] = list(contents.strings)
        return value.reshape(shape)
    itemsize = dtype.itemsize
    if byte_strides is not None:  # checked at the request: `check_upload_strides`
        extent = strided_extent(shape, byte_strides, itemsize)
    else:
        extent = count * itemsize
    if len(data) < extent or (byte_strides is None and len(data) != extent):
        raise errors.InvalidRequest(
            f"the host buffer has {len(data)} bytes but an array of shape {shape} and dtype "
            f"{dtype.kind}{' with strides ' + str(list(byte_strides)) if byte_strides else ''} "
            f"needs {extent}; send the whole array.")
    if count == 0:
        return np.zeros(shape, dtype=dtype.numpy)
    return np.ndarray(shape, dtype=dtype.numpy, buffer=data, strides=byte_strides)


def encode_host_array(session: FrontendSession, value: np.ndarray, dtype: dtypes.DType,
                      byte_strides: tuple[int, ...] | None) -> memoryview:
    """The bytes of `value` laid out as the client asked (C order when no strides)."""
    if dtype.is_string:
        contents = session.schema["xla.ifrt.proto.StringArrayContents"]()
        contents.strings.extend(bytes(x) if not isinstance(x, str) else x.encode()
                                for x in np.asarray(value, dtype=object).reshape(-1))
        return memoryview(contents.SerializeToString())
    value = np.asarray(value)
    if value.dtype != dtype.numpy:
        value = value.astype(dtype.numpy)
    if byte_strides is None or tuple(byte_strides) == _c_strides(value.shape, dtype.itemsize):
        return memoryview(byte_view(value))
    _check_rank_and_sign(byte_strides, value.shape)
    extent = strided_extent(value.shape, byte_strides, dtype.itemsize)
    out = bytearray(extent)
    if value.size:
        np.ndarray(value.shape, dtype=value.dtype, buffer=out, strides=byte_strides)[...] = value
    return memoryview(out)


def strided_extent(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> int:
    """Bytes from the first element to the end of the last, laid out by `byte_strides`."""
    if 0 in shape:
        return 0
    return itemsize + sum((d - 1) * s for d, s in zip(shape, byte_strides))


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _check_default_layout(session: FrontendSession, layout: Message, dtype: dtypes.DType,
                          shape: tuple[int, ...], sharding: Sharding) -> None:
    """Accepts only the device's default layout (row-major on CPU, the backend's own on an
    accelerator, as the client was told it), in either IFRT form."""
    device = session.fleet.device(sharding.devices[0])
    box = shard_boxes(sharding, shape)[0]
    default = session.ctl.core.controller.known_layout(dtype, shard_shape(box), device)
    check_upload_layout(session.schema, layout, len(shape), default)


def _strides(body: Message) -> tuple[int, ...] | None:
    return tuple(body.byte_strides.strides) if body.HasField("byte_strides") else None


def check_upload_strides(dtype: dtypes.DType, shape: Sequence[int],
                         byte_strides: tuple[int, ...] | None) -> None:
    """Byte strides of host data must match the shape's rank and keep every element in
    bytes of its own: a zero or overlapping stride would let a few uploaded bytes stand for
    an array of any size (the stock client never sends one: it refuses them itself)."""
    if byte_strides is None or dtype.is_string:
        return
    _check_rank_and_sign(byte_strides, shape)
    if 0 in shape:  # no element, nothing to overlap (numpy gives such arrays any strides)
        return
    extent = dtype.itemsize  # bytes spanned by the dimensions checked so far
    for stride, dim in sorted((s, d) for s, d in zip(byte_strides, shape) if d > 1):
        if stride < extent:
            raise errors.InvalidRequest(
                f"byte_strides {list(byte_strides)} make the elements of shape {list(shape)} "
                f"and dtype {dtype.kind} overlap (stride {stride} where at least {extent} "
                "bytes are needed); send each element once (np.ascontiguousarray).")
        extent = stride * (dim - 1) + extent


class _HostShard:
    """A shard's (or a whole array's) host buffer, as the controller takes it (`HostShard`):
    decoded and handed on in the turn it is here."""

    __slots__ = ("session", "handle", "dtype", "shape", "byte_strides")

    def __init__(self, session: FrontendSession, handle: HostBufferHandle, dtype: dtypes.DType,
                 shape: tuple[int, ...], byte_strides: tuple[int, ...] | None) -> None:
        self.session, self.handle, self.dtype = session, handle, dtype
        self.shape, self.byte_strides = shape, byte_strides

    def subscribe(self, receive: Callable[[np.ndarray | Exception], None]) -> None:
        def arrived(data: memoryview | None, error: errors.IsthmusError | None) -> None:
            if error is not None:
                receive(error)
                return
            try:
                # No error: the data is here.
                value = decode_host_array(self.session, cast(memoryview, data), self.dtype,
                                          self.shape, self.byte_strides)
            except Exception as e:  # noqa: BLE001 - the shards carry it
                receive(e)
                return
            receive(value)

        self.session.host_buffers.when_ready(self.handle, arrived)


def make_array_from_host_buffer(session: FrontendSession, request: Message,
                                response: Message) -> None:
    body = request.make_array_from_host_buffer_request
    serdes = session.serdes
    dtype, shape = serdes.dtype(body.dtype), serdes.shape(body.shape)
    sharding = serdes.sharding(body.sharding)
    strides = _strides(body)
    check_upload_strides(dtype, shape, strides)
    if body.HasField("layout"):
        _check_default_layout(session, body.layout, dtype, shape, sharding)
    host = _HostShard(session, body.host_buffer_handle, dtype, shape, strides)
    try:
        session.host_buffers.check_unclaimed([body.host_buffer_handle])
        array = session.ctl.arrays.make_array(dtype, shape, sharding, host)
    except BaseException:
        # Freed on arrival (a buffer another request waits for stays that request's).
        session.host_buffers.when_ready(body.host_buffer_handle, _ignore)
        raise
    handle = body.array_handle if body.HasField("array_handle") else None
    response.make_array_from_host_buffer_response.array_handle = session.bind_array(
        handle, array)


def make_arrays_from_host_buffer_shards(session: FrontendSession, request: Message,
                                        response: Message) -> None:
    body = request.make_arrays_from_host_buffer_shards_request
    out = response.make_arrays_from_host_buffer_shards_response
    out.SetInParent()
    made = 0
    try:
        session.host_buffers.check_unclaimed([buffer.host_buffer_handle for spec in body.specs
                                              for buffer in spec.host_buffers])
        if body.array_handles and len(body.array_handles) != len(body.specs):
            raise errors.InvalidRequest(
                f"{len(body.specs)} array specs but {len(body.array_handles)} array handles; "
                "send one handle per spec.")
        for index, spec in enumerate(body.specs):
            array = _array_from_shards(session, spec)
            made += 1  # its host buffers are the array's now
            handle = body.array_handles[index] if body.array_handles else None
            out.array_handles.append(session.bind_array(handle, array))
    except BaseException:
        # The host buffers no array took are freed as they arrive.
        for unused in body.specs[made:]:
            for buffer in unused.host_buffers:
                session.host_buffers.when_ready(buffer.host_buffer_handle, _ignore)
        raise


def _ignore(data: object, error: object) -> None:
    """Receives a host buffer nobody needs (of a request that failed)."""


def _array_from_shards(session: FrontendSession, spec: Message) -> Array:
    """The array of one spec of MakeArraysFromHostBufferShards."""
    # A loop puts arrays of the same specs again and again, only the handles differ: what
    # they describe is checked once per session (`_check_shards`), found by their fields.
    buffers = spec.host_buffers
    key = (spec.array_spec.SerializeToString(),
           tuple(tuple(i.indices) for i in spec.addressable_shard_indices),
           tuple((b.dtype.kind, tuple(b.shape.dims), _strides(b)) for b in buffers))
    memo = session.checked_specs
    checked = memo.get(key)
    if checked is None:
        checked = _check_shards(session, spec)
        if len(memo) >= CHECKED_SPECS:
            memo.clear()
        memo[key] = checked
    array_spec, described = checked
    pieces = [(shard.positions, _HostShard(session, buffer.host_buffer_handle, shard.dtype,
                                           shard.shape, shard.byte_strides))
              for shard, buffer in zip(described, buffers)]
    return session.ctl.arrays.make_array_from_shards(
        array_spec.dtype, array_spec.shape, array_spec.sharding, pieces)


CHECKED_SPECS = 256  # specs of host-buffer shards kept checked per session


def _check_shards(session: FrontendSession, spec: Message
                  ) -> tuple[ArraySpec, list[HostShardSpec]]:
    """One spec of MakeArraysFromHostBufferShards, checked: its array spec, and per host
    buffer the shard positions it fills, its dtype, shape and byte strides."""
    serdes = session.serdes
    array_spec = serdes.array_spec(spec.array_spec)
    if len(spec.addressable_shard_indices) != len(spec.host_buffers):
        raise errors.InvalidRequest(
            "each group of shard indices needs exactly one host buffer; got "
            f"{len(spec.addressable_shard_indices)} groups and {len(spec.host_buffers)} "
            "buffers.")
    pieces = []
    for indices, buffer in zip(spec.addressable_shard_indices, spec.host_buffers):
        dtype, shape = serdes.dtype(buffer.dtype), serdes.shape(buffer.shape)
        if dtype != array_spec.dtype:
            raise errors.InvalidRequest(
                f"a host shard has dtype {dtype.kind} but the array is "
                f"{array_spec.dtype.kind}.")
        shape = session.ctl.arrays.validate_shape(dtype, shape)
        strides = _strides(buffer)
        check_upload_strides(dtype, shape, strides)
        pieces.append(HostShardSpec(tuple(indices.indices), dtype, shape, strides))
    return array_spec, pieces


def _check_rank_and_sign(byte_strides: tuple[int, ...], shape: Sequence[int]) -> None:
    if len(byte_strides) != len(shape):
        raise errors.InvalidRequest(
            f"byte_strides {list(byte_strides)} do not match the rank of shape {list(shape)}.")
    if any(s < 0 for s in byte_strides):
        raise errors.InvalidRequest(
            f"byte_strides {list(byte_strides)} contain a negative stride; isthmus needs "
            "non-negative strides.")


def _check_download_strides(session: FrontendSession, array: Array,
                            strides: tuple[int, ...]) -> None:
    """A download's byte strides must match the rank, be non-negative and span no more
    memory than the server allows an array (strides can ask for any size of buffer)."""
    _check_rank_and_sign(strides, array.shape)
    if array.dtype.is_string:
        return
    extent = strided_extent(array.shape, strides, array.dtype.itemsize)
    limit = session.ctl.core.controller.config.max_array_bytes
    if extent > limit:
        raise errors.TooLarge(
            f"byte_strides {list(strides)} lay out the array over {extent} bytes, over the "
            f"server's limit of {limit}; ask for a denser layout.")


def copy_to_host_buffer(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.copy_to_host_buffer_request
    array = session.array(body.array_handle)
    strides = _strides(body)
    if strides is not None:
        _check_download_strides(session, array, strides)
    fetched = session.ctl.moves.fetch(array)
    response.copy_to_host_buffer_response.SetInParent()
    if fetched.done():
        # Already on the host (a small program on in-process devices), or known to have
        # failed: answered now, with the data or the error.
        try:
            data = encode_host_array(session, fetched.result(), array.dtype, strides)
        except errors.IsthmusError as e:
            session.host_buffers.fail_download(body.host_buffer_handle, e)
            raise
        session.host_buffers.publish(body.host_buffer_handle, data)
        return None

    # Answered now, before the data is on the host: the client sends its HostBufferLookup
    # at once, which waits here for the data (and fails with the fetch's error, if any), so
    # a small fetch's data leaves the moment it arrives: a round trip less than answering
    # once it is here (XLA's server does that).
    session.host_buffers.promise(body.host_buffer_handle)

    async def finish() -> None:
        try:
            value = await fetched
            data = encode_host_array(session, value, array.dtype, strides)
        except Exception as e:  # noqa: BLE001 - the lookup reports it
            session.host_buffers.fail_download(
                body.host_buffer_handle, as_download_error(e))
            return
        session.host_buffers.publish(body.host_buffer_handle, data)

    session.background(finish())
    return None


def as_download_error(e: BaseException) -> errors.IsthmusError:
    if isinstance(e, errors.IsthmusError):
        return e
    logger.exception("a download failed")
    return errors.InternalError(
        f"copying the array to the host failed unexpectedly ({type(e).__name__}: {e}); this "
        "is a bug in isthmus: please report it with the server log.")
