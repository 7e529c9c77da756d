"""Buffers a host makes from its own buffers on a device (a part of `DeviceHost`): a copy to
another device or memory kind, a buffer assembled from boxes of others (a reshard step), and
a bitcast. Each stores its result in the host's `BufferStore`, or the error that stopped it:
nothing here raises."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxlibDevice, JaxSharding
from isthmus.ids import BufferId
from isthmus.transport.host import Part
from isthmus.worker.buffers import BufferStore, missing
from isthmus.worker.slots import Failed, HostArray, move


def copy(buffers: BufferStore, src: BufferId, dst: BufferId,
         target: Callable[[], JaxSharding]) -> None:
    """Copies a buffer to `target()` (another local device, or memory kind)."""
    value = buffers.slot(src)
    if value is None or isinstance(value, Failed):
        buffers.store(dst, value if value is not None else Failed(missing(src)))
        return
    try:
        sharding = target()
        if isinstance(value, HostArray):
            buffers.store(dst, HostArray(value.value))
            return
        buffers.store(dst, move(value, sharding))
        buffers.inherit(dst, (src,))
    except Exception as e:  # noqa: BLE001
        buffers.fail(dst, errors.from_runtime_error(
            e, errors.ExecutionError, "copying an array between devices failed"))


def assemble(buffers: BufferStore, devices: Mapping[int, JaxlibDevice], dst: BufferId,
             device_id: int, memory_kind: str | None, dtype: np.dtype | type[object] | None,
             shape: tuple[int, ...], parts: Sequence[Part]) -> None:
    """Builds `dst` on a device from boxes of local buffers (a reshard step).

    Each part copies `src[src_box]` into `dst[dst_box]`. The work is dispatched as jax
    operations, so it runs after the sources are computed without blocking here.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    try:
        device = devices[device_id]
        target = SingleDeviceSharding(device, memory_kind=memory_kind)
        sources = [(buffers.value(src), src_box, dst_box) for src, src_box, dst_box in parts]
        whole = tuple(slice(0, d) for d in shape)
        if len(sources) == 1 and sources[0][2] == whole:
            value, src_box, _ = sources[0]
            result = move(value[src_box], target)
        else:
            result = jnp.zeros(shape, dtype, device=device)
            single = SingleDeviceSharding(device)
            for value, src_box, dst_box in sources:
                result = result.at[dst_box].set(move(value[src_box], single))
            if memory_kind is not None:
                result = jax.device_put(result, target)
        buffers.store(dst, result)
        buffers.inherit(dst, [src for src, _, _ in parts])
    except Exception as e:  # noqa: BLE001
        buffers.fail(dst, errors.from_runtime_error(
            e, errors.ExecutionError, "resharding the array failed"))


def bitcast(buffers: BufferStore, src: BufferId, dst: BufferId, dtype: np.dtype | type[object],
            shape: tuple[int, ...]) -> None:
    """`dst` holds the bytes of `src` read as another dtype and shape."""
    import jax

    try:
        value = buffers.value(src)
        if np.dtype(dtype).itemsize != value.dtype.itemsize:
            raise errors.Unimplemented(
                f"bitcasting {value.dtype} to {np.dtype(dtype)} changes the element size, "
                "which isthmus does not support; bitcast between same-size dtypes.")
        converted = jax.lax.bitcast_convert_type(value, dtype)
        buffers.store(dst, converted.reshape(shape))
        buffers.inherit(dst, (src,))
    except Exception as e:  # noqa: BLE001
        buffers.fail(dst, errors.from_runtime_error(
            e, errors.InvalidRequest, "bitcasting the array failed"))
