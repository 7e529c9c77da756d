"""Arrays over existing buffers: disassembling, assembling, taking a fully replicated shard
and remapping make new arrays over the same shards, with no device work.

An array that is a whole group counts as one more holder of the group; one made of shards of
other arrays holds each of its `Buffer` views one by one. `SessionViews` is the part of a
`Session` (session.py) that makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, Buffer, first_error


class ViewArrays(Protocol):
    """What arrays over existing buffers need of the session's arrays (`SessionArrays`)."""

    def share(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
              buffers: Sequence[Buffer], error: errors.IsthmusError | None = None) -> Array: ...

    def validate_shape(self, dtype: dtypes.DType, shape: Sequence[int]) -> tuple[int, ...]: ...

    def donate_in_order(self, array: Array) -> None: ...


class SessionViews:
    """New arrays over the shards of a session's arrays (a part of `Session`, which holds
    them in its arrays, `ViewArrays`)."""

    def __init__(self, arrays: ViewArrays) -> None:
        self.arrays = arrays

    def disassemble(self, array: Array, donate: bool = False) -> list[Array]:
        """One single-device array per shard, in the order of the sharding's devices."""
        boxes = sh.shard_boxes(array.sharding, array.shape)
        result = [
            self.arrays.share(array.dtype, sh.shard_shape(box),
                              sh.Sharding.single(buffer.device.id, array.sharding.memory_kind),
                              [buffer], array.error)
            for buffer, box in zip(array.shards, boxes)]
        if donate:
            self.arrays.donate_in_order(array)
        return result

    def assemble(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                 parts: Sequence[Array], donate: bool = False) -> Array:
        """An array made of single-device arrays (one per device of `sharding`)."""
        shape = self.arrays.validate_shape(dtype, shape)
        boxes = sh.shard_boxes(sharding, shape)
        by_device: dict[int, Array] = {}
        for single in parts:
            if len(single.shards) != 1:
                raise errors.InvalidRequest(
                    "assembling takes single-device arrays, but one of them has "
                    f"{len(single.shards)} shards; disassemble it first.")
            by_device[single.shards[0].device.id] = single
        buffers = []
        for device_id, box in zip(sharding.devices, boxes):
            part = by_device.get(device_id)
            if part is None:
                raise errors.InvalidRequest(
                    f"no single-device array was given for device {device_id} of the "
                    "sharding; pass one array per device of the sharding.")
            if part.shape != sh.shard_shape(box) or part.dtype != dtype:
                raise errors.InvalidRequest(
                    f"the array for device {device_id} has shape {part.shape} and dtype "
                    f"{part.dtype.kind}, but the sharding needs {sh.shard_shape(box)} and "
                    f"{dtype.kind} there.")
            default = part.shards[0].device.memory_kinds[0]
            if (part.sharding.memory_kind or default) != (sharding.memory_kind or default):
                raise errors.InvalidRequest(
                    f"the array for device {device_id} is in memory kind "
                    f"{part.sharding.memory_kind!r} but the sharding says "
                    f"{sharding.memory_kind!r}; copy it there first.")
            buffers.append(part.shards[0])
        error = first_error(a for a in parts if a.error is not None)
        result = self.arrays.share(dtype, shape, sharding, buffers, error)
        if donate:
            for part in parts:
                self.arrays.donate_in_order(part)
        return result

    def fully_replicated_shard(self, array: Array, donate: bool = False) -> Array:
        if not sh.is_fully_replicated(array.sharding, array.shape):
            raise errors.InvalidRequest(
                "the array is not fully replicated, so no single shard holds all of it; "
                "reshard it to a replicated sharding first.")
        buffer = array.shards[0]
        result = self.arrays.share(
            array.dtype, array.shape,
            sh.Sharding.single(buffer.device.id, array.sharding.memory_kind), [buffer],
            array.error)
        if donate:
            self.arrays.donate_in_order(array)
        return result

    def remap(self, inputs: Sequence[Array],
              outputs: Sequence[tuple[dtypes.DType, tuple[int, ...], sh.Sharding]],
              mappings: Sequence[tuple[int, int, range, range]], donate: bool = False
              ) -> list[Array]:
        """New arrays whose shards are shards of the inputs, as a remap plan says.

        Each mapping is (input index, output index, input shard range, output shard range).
        """
        slots: list[list[Buffer | None]] = [[None] * len(spec[2].devices) for spec in outputs]
        # (group, position) -> (dtype, shard shape, memory kind) of each input shard
        sources: dict[tuple[int, int], tuple[dtypes.DType, tuple[int, ...], str | None]] = {}
        boxes: dict[tuple[int, int], tuple[tuple[int, ...], sh.Box]] = {}  # array shape, box
        for array in inputs:
            for buffer, box in zip(array.shards, sh.shard_boxes(array.sharding, array.shape)):
                sources[id(buffer.group), buffer.position] = (
                    array.dtype, sh.shard_shape(box), array.sharding.memory_kind)
                boxes[id(buffer.group), buffer.position] = (array.shape, box)
        for in_index, out_index, src, dst in mappings:
            if not (0 <= in_index < len(inputs) and 0 <= out_index < len(outputs)):
                raise errors.InvalidRequest(
                    f"the remap plan maps array {in_index} to array {out_index}, outside the "
                    f"{len(inputs)} inputs and {len(outputs)} outputs.")
            shards = inputs[in_index].shards
            for name, interval, count in (("from", src, len(shards)),
                                          ("to", dst, len(slots[out_index]))):
                if not (0 <= interval.start <= count and 0 <= interval.stop <= count):
                    raise errors.InvalidRequest(
                        f"a remap plan interval {name} [{interval.start}, {interval.stop}) "
                        f"reaches outside the {count} shards of its array; give intervals "
                        f"within 0..{count}.")
            if len(src) != len(dst):
                raise errors.InvalidRequest(
                    "a remap plan interval maps a different number of shards than it "
                    "receives; make both intervals the same length.")
            for s, d in zip(src, dst):
                if not (0 <= s < len(shards) and 0 <= d < len(slots[out_index])):
                    raise errors.InvalidRequest(
                        f"the remap plan names shard {s} -> {d}, outside the arrays' shards.")
                slots[out_index][d] = shards[s]
        result = []
        for index, ((dtype, shape, sharding), slot) in enumerate(zip(outputs, slots)):
            if any(b is None for b in slot):
                raise errors.InvalidRequest(
                    "the remap plan leaves some output shards unmapped; map every shard.")
            buffers = cast("list[Buffer]", slot)  # every shard is mapped (just checked)
            shape = self.arrays.validate_shape(dtype, shape)
            if sh.splits(sharding, shape):  # each shard keeps its place in its array
                placed = [boxes[id(b.group), b.position] for b in buffers]
                if any(whole != shape for whole, _ in placed):
                    raise errors.Unimplemented(
                        f"remap output {index} has a ConcreteEvenSharding that splits it, "
                        "from shards of arrays of another shape: where each shard lies is "
                        "not defined; use an HloSharding (jax's NamedSharding) instead.")
                sharding = sh.even_from(sharding, [box for _, box in placed], shape,
                                        f"remap output {index}")
            _check_views(f"remap output {index}", dtype, shape, sharding,
                         buffers, [sources[id(b.group), b.position] for b in buffers])
            for device_id, buffer in zip(sharding.devices, buffers):
                if buffer is not None and buffer.device.id != device_id:
                    raise errors.InvalidRequest(
                        f"the remap plan puts a shard held on device {buffer.device.id} at "
                        f"the place of device {device_id}; remapping cannot move data.")
            error = first_error(a for a in inputs if a.error is not None)
            result.append(self.arrays.share(dtype, shape, sharding, buffers, error))
        if donate:
            for array in inputs:
                self.arrays.donate_in_order(array)
        return result


def _check_views(what: str, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
                 buffers: Sequence[Buffer],
                 sources: Sequence[tuple[dtypes.DType, tuple[int, ...], str | None]]) -> None:
    """Refuses a new array over existing shards that would read them as another dtype,
    shape or memory kind: a program given such an array would read past its buffers."""
    boxes = sh.shard_boxes(sharding, shape)
    for buffer, box, (src_dtype, src_shape, src_kind) in zip(buffers, boxes, sources):
        if (src_dtype, src_shape) != (dtype, sh.shard_shape(box)):
            raise errors.InvalidRequest(
                f"{what} would read the {src_dtype.kind}{list(src_shape)} shard on device "
                f"{buffer.device.id} as {dtype.kind}{list(sh.shard_shape(box))}; give the "
                "output the dtype and a shape and sharding whose shards match the inputs'.")
        default = buffer.device.memory_kinds[0]
        if (src_kind or default) != (sharding.memory_kind or default):
            raise errors.InvalidRequest(
                f"{what} puts a shard in memory kind {src_kind!r} under memory kind "
                f"{sharding.memory_kind!r}; remapping cannot move data: keep the inputs' "
                "memory kind.")
