"""IFRT wire objects <-> isthmus records: dtypes, shapes, shardings, array specs.

Shardings travel as `xla.ifrt.Serialized{type_name, data}`; the type name says which proto
`data` holds. Everything the client may send is validated here, before it reaches the
controller: a malformed object becomes `InvalidRequest` naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from isthmus import dtypes, errors
from isthmus.controller.sharding import Sharding, ShardingKind
from isthmus.frontend.message import Message
from isthmus.ids import DeviceId
from isthmus.protocol.schema import Schema

HLO_SHARDING = "xla::ifrt::HloSharding"
SINGLE_DEVICE_SHARDING = "xla::ifrt::SingleDeviceSharding"
CONCRETE_EVEN_SHARDING = "xla::ifrt::ConcreteEvenSharding"
CONCRETE_SHARDING = "xla::ifrt::ConcreteSharding"
OPAQUE_SHARDING = "xla::ifrt::OpaqueSharding"
SHARDING_PARAM_SHARDING = "xla::ifrt::ShardingParamSharding"

MAX_RANK = 64


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
    dtype: dtypes.DType
    shape: tuple[int, ...]
    sharding: Sharding


@dataclasses.dataclass(frozen=True, slots=True)
class HostShardSpec:
    """One host buffer of a MakeArraysFromHostBufferShards spec, checked."""

    positions: tuple[int, ...]  # the shards (device positions of the sharding) it fills
    dtype: dtypes.DType
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...] | None  # None: C order


class Serdes:
    """Converters bound to the installed schema."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        kind = schema["xla.ifrt.DTypeProto"].DESCRIPTOR.enum_types_by_name["Kind"]
        self._kind_by_number = {v.number: v.name for v in kind.values}
        self._number_by_kind = {v.name: v.number for v in kind.values}
        self._op_sharding = schema["xla.OpSharding"]
        self._hlo = schema["xla.ifrt.HloShardingProto"]
        self._single = schema["xla.ifrt.SingleDeviceShardingProto"]
        self._even = schema["xla.ifrt.ConcreteEvenShardingProto"]
        self._opaque = schema["xla.ifrt.OpaqueShardingProto"]
        self._sharding_proto = schema["xla.ifrt.ShardingProto"]
        self._dtype_proto = schema["xla.ifrt.DTypeProto"]
        self._shape_proto = schema["xla.ifrt.ShapeProto"]
        self._to_wire_cache: dict[Sharding, Message] = {}

    # ---- dtypes and shapes ---------------------------------------------------------------

    def dtype(self, proto: Message) -> dtypes.DType:
        name = self._kind_by_number.get(proto.kind)
        dtype = dtypes.BY_KIND.get(name or "")
        if dtype is None or dtype is dtypes.TOKEN:
            raise errors.InvalidRequest(
                f"dtype kind {name or proto.kind} is not supported by isthmus; use a numeric, "
                "boolean or string dtype.")
        return dtype

    def dtype_proto(self, dtype: dtypes.DType) -> Message:
        return self._dtype_proto(kind=self._number_by_kind[dtype.kind])

    def shape(self, proto: Message) -> tuple[int, ...]:
        dims = tuple(proto.dims)
        if len(dims) > MAX_RANK:
            raise errors.InvalidRequest(
                f"shape has rank {len(dims)}; isthmus accepts up to rank {MAX_RANK}.")
        if any(d < 0 for d in dims):
            raise errors.InvalidRequest(
                f"shape {list(dims)} has a negative dimension; dimensions must be >= 0.")
        return dims

    def shape_proto(self, shape: tuple[int, ...]) -> Message:
        return self._shape_proto(dims=shape)

    # ---- shardings -----------------------------------------------------------------------

    def sharding(self, proto: Message) -> Sharding:
        """A `ShardingProto` (a Serialized sharding) as a `Sharding`."""
        serialized = proto.serialized_sharding
        type_name = serialized.type_name
        try:
            if type_name == HLO_SHARDING:
                msg = self._hlo.FromString(serialized.data)
                return Sharding(ShardingKind.HLO, _devices(msg.devices.device_ids),
                                _memory_kind(msg), msg.xla_op_sharding.SerializeToString())
            if type_name == SINGLE_DEVICE_SHARDING:
                msg = self._single.FromString(serialized.data)
                return Sharding.single(DeviceId(msg.device_id), _memory_kind(msg))
            if type_name == CONCRETE_EVEN_SHARDING:
                msg = self._even.FromString(serialized.data)
                devices = _devices(msg.devices.device_ids)
                if msg.is_fully_replicated:
                    return Sharding(ShardingKind.REPLICATED, devices, _memory_kind(msg))
                return Sharding(ShardingKind.CONCRETE_EVEN, devices, _memory_kind(msg),
                                shard_shape=tuple(msg.shard_shape.dims))
            if type_name == OPAQUE_SHARDING:
                msg = self._opaque.FromString(serialized.data)
                return Sharding(ShardingKind.OPAQUE, _devices(msg.devices.device_ids),
                                _memory_kind(msg))
        except errors.IsthmusError:
            raise
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise errors.InvalidRequest(
                f"a {type_name} does not parse ({e}); send shardings made by jax.") from None
        if not type_name:
            raise errors.InvalidRequest("a sharding is missing; every array needs one.")
        raise errors.Unimplemented(
            f"sharding type {type_name!r} is not supported by isthmus; use jax's "
            "NamedSharding, PositionalSharding or SingleDeviceSharding.")

    def sharding_proto(self, sharding: Sharding) -> Message:
        cached = self._to_wire_cache.get(sharding)
        if cached is not None:
            return cached
        kind = sharding.kind
        if kind is ShardingKind.SINGLE_DEVICE:
            msg = self._single(device_id=sharding.devices[0])
            type_name = SINGLE_DEVICE_SHARDING
        elif kind is ShardingKind.HLO:
            msg = self._hlo()
            msg.devices.device_ids.extend(sharding.devices)
            msg.xla_op_sharding.ParseFromString(sharding.op_sharding)
            type_name = HLO_SHARDING
        elif kind in (ShardingKind.REPLICATED, ShardingKind.CONCRETE_EVEN):
            msg = self._even(is_fully_replicated=kind is ShardingKind.REPLICATED)
            msg.devices.device_ids.extend(sharding.devices)
            if sharding.shard_shape is not None:
                msg.shard_shape.dims.extend(sharding.shard_shape)
            type_name = CONCRETE_EVEN_SHARDING
        else:
            msg = self._opaque()
            msg.devices.device_ids.extend(sharding.devices)
            type_name = OPAQUE_SHARDING
        if sharding.memory_kind is not None:
            msg.memory_kind = sharding.memory_kind
        proto = self._sharding_proto()
        proto.serialized_sharding.type_name = type_name
        proto.serialized_sharding.data = msg.SerializeToString()
        if len(self._to_wire_cache) > 4096:
            self._to_wire_cache.clear()
        self._to_wire_cache[sharding] = proto
        return proto

    def array_spec(self, proto: Message) -> ArraySpec:
        return ArraySpec(self.dtype(proto.dtype), self.shape(proto.shape),
                         self.sharding(proto.sharding))


def _devices(ids: Iterable[int]) -> tuple[DeviceId, ...]:
    devices = tuple(DeviceId(i) for i in ids)
    if not devices:
        raise errors.InvalidRequest("a sharding names no devices; give at least one device.")
    if len(set(devices)) != len(devices):
        raise errors.InvalidRequest(
            f"a sharding names a device twice ({list(devices)[:16]}); name each device once.")
    return devices


def _memory_kind(msg: Message) -> str | None:
    return msg.memory_kind if msg.HasField("memory_kind") and msg.memory_kind else None
