"""How an array's shape is laid out over a list of devices.

A `Sharding` names its devices (global ids, in the order of the IFRT device list) and, for
HLO shardings, carries the `xla.OpSharding` bytes. `shard_boxes` turns a sharding and a global
shape into the index box each device holds; the result is cached, since the same few
shardings recur on every step of a training loop.

Tile assignments in an OpSharding number devices by their position in the device list, not by
global id (the IFRT convention).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence
from typing import TypeVar

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.ids import DeviceId

# (start, stop) per dimension.
Box = tuple[tuple[int, int], ...]
T = TypeVar("T")  # what a source of `pieces` is (the caller's buffer)


class ShardingKind(enum.Enum):
    SINGLE_DEVICE = "single_device"  # one device holds the whole array
    HLO = "hlo"  # an xla.OpSharding over the device list
    REPLICATED = "replicated"  # every device holds the whole array (ConcreteEven, replicated)
    CONCRETE_EVEN = "concrete_even"  # devices hold shard_shape pieces; order as listed
    OPAQUE = "opaque"  # devices known, layout unknown: only whole-array operations


@dataclasses.dataclass(frozen=True, slots=True)
class Sharding:
    """Placement of an array over devices."""

    kind: ShardingKind
    devices: tuple[DeviceId, ...]  # the IFRT device list, in order
    memory_kind: str | None = None  # None: the device's default memory
    op_sharding: bytes = b""  # serialized xla.OpSharding, for kind HLO
    shard_shape: tuple[int, ...] | None = None  # for CONCRETE_EVEN
    # For a CONCRETE_EVEN sharding that splits the array: the box of each device position,
    # taken from the array its shards came from (`even_from`); IFRT defines no mapping.
    boxes: tuple[Box, ...] | None = None

    @staticmethod
    def single(device: DeviceId, memory_kind: str | None = None) -> Sharding:
        return Sharding(ShardingKind.SINGLE_DEVICE, (device,), memory_kind)

    def with_devices(self, devices: tuple[DeviceId, ...], memory_kind: str | None) -> Sharding:
        """The same layout over another device list of the same length (CopyArrays)."""
        return dataclasses.replace(self, devices=devices, memory_kind=memory_kind)


@dataclasses.dataclass(frozen=True, slots=True)
class _Tiling:
    tiles: tuple[int, ...]  # number of tiles along each array dimension
    coords: tuple[tuple[int, ...], ...]  # tile coordinate of each device position


def _replicated_tiling(rank: int, count: int) -> _Tiling:
    return _Tiling((1,) * rank, ((0,) * rank,) * count)


def _check_fields(op_sharding: bytes, count: int) -> None:
    """Refuses an xla.OpSharding whose tile assignment does not fit `count` devices, read
    with Python's protobuf before XLA's own code sees it (XLA trusts an iota's permutation
    and sizes: a hostile one reads out of bounds)."""
    from isthmus.protocol.schema import schema

    op = schema()["xla.OpSharding"].FromString(op_sharding)
    kinds = type(op).Type
    if op.type == kinds.Value("TUPLE") or op.type not in kinds.values():
        raise errors.InvalidRequest(
            "the sharding's xla.OpSharding is a tuple or of an unknown type; give one "
            "sharding per array.")
    if op.type != kinds.Value("OTHER"):
        return
    dims, reshape = list(op.tile_assignment_dimensions), list(op.iota_reshape_dims)
    perm = list(op.iota_transpose_perm)
    if not dims or any(d <= 0 for d in dims) or math.prod(dims) != count or (
            op.tile_assignment_devices and len(op.tile_assignment_devices) != count) or (
            not op.tile_assignment_devices and (
                any(d <= 0 for d in reshape) or math.prod(reshape) != count
                or sorted(perm) != list(range(len(reshape))))):
        raise errors.InvalidRequest(
            f"the sharding's tile assignment (dimensions {dims[:8]}, iota {reshape[:8]} "
            f"permuted {perm[:8]}) does not cover its {count} devices once each; the "
            "sharding does not fit its device list.")


@functools.lru_cache(maxsize=4096)
def _hlo_tiling(op_sharding: bytes, rank: int, count: int) -> _Tiling:
    xc = jax_compat.xla_client()  # jaxlib parses iota tile assignments for us
    try:
        _check_fields(op_sharding, count)
    except errors.IsthmusError:
        raise
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise errors.InvalidRequest(
            f"the sharding's xla.OpSharding does not parse ({e}); send a sharding made by "
            "jax.") from None
    proto = xc.OpSharding()
    try:
        proto.ParseFromString(op_sharding)
        hlo = xc.HloSharding.from_proto(proto)
    except Exception as e:  # noqa: BLE001 - jaxlib raises several types here
        raise errors.InvalidRequest(
            f"the sharding's xla.OpSharding does not parse ({e}); send a sharding made by jax."
        ) from None
    # Unreduced (partial sums) and manual shardings keep a full-shape value per device.
    if (hlo.is_replicated() or hlo.is_manual() or hlo.is_maximal() or hlo.is_unknown()
            or hlo.is_unreduced()):
        return _replicated_tiling(rank, count)
    dims = list(hlo.tile_assignment_dimensions())
    devices = list(hlo.tile_assignment_devices())
    if len(dims) < rank:
        raise errors.InvalidRequest(
            f"the sharding tiles {len(dims)} dimensions but the array has rank {rank}; "
            "the sharding does not fit the array's shape."
        )
    if math.prod(dims) != len(devices) or sorted(devices) != list(range(count)):
        raise errors.InvalidRequest(
            f"the sharding's tile assignment covers devices {sorted(devices)[:8]}... but the "
            f"device list has {count} devices; the sharding does not fit its device list."
        )
    coords: list[tuple[int, ...] | None] = [None] * count
    for flat, position in enumerate(devices):
        full = _unravel(flat, dims)
        coords[position] = tuple(full[:rank])
    return _Tiling(tuple(dims[:rank]), tuple(c for c in coords if c is not None))


def _unravel(flat: int, dims: list[int]) -> list[int]:
    out = [0] * len(dims)
    for i in range(len(dims) - 1, -1, -1):
        flat, out[i] = divmod(flat, dims[i])
    return out


def _tiling(sharding: Sharding, shape: tuple[int, ...]) -> _Tiling:
    rank, count = len(shape), len(sharding.devices)
    if sharding.kind is ShardingKind.HLO:
        return _hlo_tiling(sharding.op_sharding, rank, count)
    if sharding.kind is ShardingKind.CONCRETE_EVEN and sharding.shard_shape is not None:
        if tuple(sharding.shard_shape) != tuple(shape):
            raise errors.Unimplemented(
                "a ConcreteEvenSharding that splits the array has no defined index mapping; "
                "use an HloSharding (jax's NamedSharding) instead."
            )
    if sharding.kind is ShardingKind.OPAQUE:
        raise errors.Unimplemented(
            "an OpaqueSharding has no index mapping, so its shards cannot be computed; "
            "use an HloSharding (jax's NamedSharding) instead."
        )
    return _replicated_tiling(rank, count)


@functools.lru_cache(maxsize=8192)
def shard_boxes(sharding: Sharding, shape: tuple[int, ...]) -> tuple[Box, ...]:
    """The index box each device position holds, in device-list order.

    Uneven dimensions follow XLA: tiles of ceil(n / tiles), the last ones shorter or empty.
    """
    if sharding.boxes is not None:
        return sharding.boxes
    tiling = _tiling(sharding, shape)
    boxes = []
    for coord in tiling.coords:
        box = []
        for dim, tiles, index in zip(shape, tiling.tiles, coord):
            size = -(-dim // tiles) if tiles else dim
            start = min(index * size, dim)
            box.append((start, min(start + size, dim)))
        boxes.append(tuple(box))
    return tuple(boxes)


def splits(sharding: Sharding, shape: tuple[int, ...]) -> bool:
    """A ConcreteEvenSharding whose shards are pieces of the array, with no boxes yet."""
    return (sharding.kind is ShardingKind.CONCRETE_EVEN and sharding.boxes is None
            and sharding.shard_shape is not None and tuple(sharding.shard_shape) != shape)


def even_from(target: Sharding, boxes: Sequence[Box], shape: tuple[int, ...],
              what: str) -> Sharding:
    """`target`, a ConcreteEvenSharding that splits an array of `shape`, given the boxes of
    the shards that land on its devices, in device-list order: IFRT's CopyArrays, Reshard
    and RemapArrays move shard i of the source to device i of such a target (jax's
    device_put between meshes and its reorder_shards send this). Refuses boxes that are not
    the target's shard shape or do not cover the array once."""
    wanted = tuple(target.shard_shape or ())
    if len(boxes) != len(target.devices) or any(shard_shape(b) != wanted for b in boxes):
        raise errors.InvalidRequest(
            f"{what}: a ConcreteEvenSharding of shard shape {list(wanted)} over "
            f"{len(target.devices)} devices does not match the source's {len(boxes)} shards "
            f"({', '.join(_box_text(b) for b in boxes[:4])}); give a sharding whose shards "
            "are the source's, or an HloSharding (jax's NamedSharding).")
    if len(boxes) * math.prod(wanted) != math.prod(shape) * _copies(boxes):
        raise errors.InvalidRequest(
            f"{what}: the source's shards do not cover the {list(shape)} array evenly; "
            "use an HloSharding (jax's NamedSharding) instead.")
    return dataclasses.replace(target, boxes=tuple(boxes))


def _copies(boxes: Sequence[Box]) -> int:
    """How many times each distinct box occurs (1 when they differ), or 0 if not evenly."""
    counts: dict[Box, int] = {}
    for box in boxes:
        counts[box] = counts.get(box, 0) + 1
    values = set(counts.values())
    return values.pop() if len(values) == 1 else 0


def shard_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def is_fully_replicated(sharding: Sharding, shape: tuple[int, ...]) -> bool:
    """Every device holds the whole array."""
    if len(sharding.devices) == 1:
        return True
    whole = tuple((0, d) for d in shape)
    return all(box == whole for box in shard_boxes(sharding, shape))


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


@functools.lru_cache(maxsize=8192)
def shard_nbytes(sharding: Sharding, shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Bytes of each device position's shard."""
    return tuple(math.prod(shard_shape(box)) * itemsize for box in shard_boxes(sharding, shape))


@functools.lru_cache(maxsize=4096)
def placement_mismatch(given: Sharding, expected: Sharding, shape: tuple[int, ...]
                       ) -> str | None:
    """Why an array laid out by `given` cannot be read as one laid out by `expected` (None:
    it can). Each device of `expected` must hold, in `given`, exactly the index box
    `expected` puts there; the order of the device lists does not matter, the boxes do."""
    held: dict[DeviceId, Box] = {}
    for device, box in zip(given.devices, shard_boxes(given, shape)):
        held.setdefault(device, box)
    for device, box in zip(expected.devices, shard_boxes(expected, shape)):
        have = held.get(device)
        if have is None:
            return f"has no shard on device {device}"
        if have != box:
            return (f"holds {_box_text(have)} on device {device} where the program reads "
                    f"{_box_text(box)}")
    return None


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def pieces(sources: Sequence[tuple[T, Box]], dst_box: Box
           ) -> list[tuple[T, tuple[slice, ...], tuple[slice, ...], int]]:
    """The distinct regions of `dst_box` that the sources hold: (source, slices into the
    source, slices into the destination, elements), one source per region."""
    found: list[tuple[T, tuple[slice, ...], tuple[slice, ...], int]] = []
    seen: set[Box] = set()
    for source, box in sources:
        lo = tuple(max(s0, d0) for (s0, _), (d0, _) in zip(box, dst_box))
        hi = tuple(min(s1, d1) for (_, s1), (_, d1) in zip(box, dst_box))
        region = tuple(zip(lo, hi))
        if (dst_box and any(a >= b for a, b in zip(lo, hi))) or region in seen:
            continue
        seen.add(region)
        found.append((source,
                      tuple(slice(a - s0, b - s0) for a, b, (s0, _) in zip(lo, hi, box)),
                      tuple(slice(a - d0, b - d0) for a, b, (d0, _) in zip(lo, hi, dst_box)),
                      math.prod(b - a for a, b in region)))
    return found
