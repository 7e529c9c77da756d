"""pathwaysutils' reshard program: arrays moved to new shardings by the workers.

`pathwaysutils.experimental.reshard.reshard(x, sharding, donate=...)` (pathwaysutils 0.1.13)
compiles a `PluginProgram` whose JSON is

    {"reshardRequest": {"donateInput": bool,
                        "inSharding": [S, ...], "outSharding": [S, ...]}}
    S = {"devices": {"device_ids": [int, ...]},
         "xla_hlo_sharding": base64 of an xla.OpSharding over those devices (by position),
         "memory_kind": str (only when the sharding names one)}

one S per array, and calls it with the arrays (`PluginExecutable.call(arrays, out_shardings,
out_avals)`). The request names no dtypes or shapes: they come with the arrays. Field names
are read as protobuf's JSON reads them (lowerCamel or the proto's own name). Every field is
checked here and against the fleet; the arguments are checked against `inSharding` when the
program runs (`Session.moves.run_reshard`), which moves them as `jax.device_put` does.
"""

from __future__ import annotations

import base64
import binascii

from isthmus import errors
from isthmus.controller import sharding as sh
from isthmus.controller.executables import Executable
from isthmus.controller.session_moves import ReshardPlan
from isthmus.frontend.session import FrontendSession
from isthmus.ids import DeviceId
from isthmus.protocol.schema import Schema

REQUEST = "reshardRequest"
# Each field under its lowerCamel name, with the proto name protobuf's JSON also accepts.
_REQUEST_FIELDS = {"donateInput": "donate_input", "inSharding": "in_sharding",
                   "outSharding": "out_sharding"}
_SHARDING_FIELDS = {"devices": "devices", "xlaHloSharding": "xla_hlo_sharding",
                    "memoryKind": "memory_kind"}
_DEVICES_FIELDS = {"deviceIds": "device_ids"}
# xla.OpSharding.Type values the server cannot read an index mapping from.
_TUPLE = 2


def plan_of(body: object) -> ReshardPlan:
    """The plan of a `reshardRequest` body; InvalidRequest naming the field that is wrong."""
    fields = _fields(body, REQUEST, _REQUEST_FIELDS)
    donate = fields.get("donateInput", False)
    if not isinstance(donate, bool):
        raise errors.InvalidRequest(
            f"{REQUEST}.donateInput must be true or false, not {donate!r}.")
    sources = _shardings(fields, "inSharding")
    targets = _shardings(fields, "outSharding")
    if len(sources) != len(targets):
        raise errors.InvalidRequest(
            f"{REQUEST} names {len(sources)} input shardings (inSharding) but "
            f"{len(targets)} output shardings (outSharding); give one of each per array.")
    return ReshardPlan(sources, targets, donate)


def compile_reshard(session: FrontendSession, plan: ReshardPlan) -> Executable:
    """Starts a Compile of a reshard plan: checks its shardings against the session's fleet
    (devices, memory kinds, tile assignments), and returns the session's executable."""
    for field, shardings in (("inSharding", plan.sources), ("outSharding", plan.targets)):
        for index, sharding in enumerate(shardings):
            where = f"{REQUEST}.{field}[{index}]"
            _check_op_sharding(session.serdes.schema, sharding, where)
            try:
                devices = session.fleet.devices_of(sharding.devices)
            except errors.IsthmusError as e:
                raise errors.InvalidRequest(f"{where}.devices: {e.message}") from None
            kind = sharding.memory_kind
            for device in devices:
                if kind is not None and kind not in device.memory_kinds:
                    raise errors.InvalidRequest(
                        f"{where}.memory_kind {kind!r} does not exist on device {device.id} "
                        f"(it has {', '.join(device.memory_kinds)}); pick one of those.")
    return session.ctl.moves.compile_reshard(plan)



def _fields(body: object, where: str, names: dict[str, str]) -> dict[str, object]:
    """`body`'s fields by their lowerCamel names; refuses unknown and repeated fields."""
    if not isinstance(body, dict):
        raise errors.InvalidRequest(f"{where} must be a JSON object, not {_kind(body)}.")
    by_name = {alias: camel for camel, alias in names.items()} | {c: c for c in names}
    fields: dict[str, object] = {}
    for key, value in body.items():
        camel = by_name.get(key)
        if camel is None:
            raise errors.InvalidRequest(
                f"{where}.{key} is not a field isthmus knows (it reads {sorted(names)}); "
                "send a request made by pathwaysutils.")
        if camel in fields:
            raise errors.InvalidRequest(f"{where}.{camel} is given twice.")
        fields[camel] = value
    return fields


def _shardings(fields: dict[str, object], name: str) -> tuple[sh.Sharding, ...]:
    items = fields.get(name)
    if not isinstance(items, list) or not items:
        raise errors.InvalidRequest(
            f"{REQUEST}.{name} must be a non-empty list of shardings, one per array, not "
            f"{_kind(items)}.")
    return tuple(_sharding(item, f"{REQUEST}.{name}[{index}]")
                 for index, item in enumerate(items))


def _sharding(body: object, where: str) -> sh.Sharding:
    fields = _fields(body, where, _SHARDING_FIELDS)
    devices = _fields(fields.get("devices"), f"{where}.devices", _DEVICES_FIELDS).get(
        "deviceIds")
    if (not isinstance(devices, list) or not devices or
            not all(type(d) is int and d >= 0 for d in devices)):
        raise errors.InvalidRequest(
            f"{where}.devices.device_ids must be a non-empty list of device ids, not "
            f"{_kind(devices)}.")
    if len(set(devices)) != len(devices):
        raise errors.InvalidRequest(
            f"{where}.devices.device_ids names a device twice ({devices[:16]}); name each "
            "device once.")
    encoded = fields.get("xlaHloSharding")
    try:
        if not isinstance(encoded, str):
            raise TypeError
        op_sharding = base64.b64decode(encoded, validate=True)
    except (TypeError, binascii.Error):
        raise errors.InvalidRequest(
            f"{where}.xla_hlo_sharding must be a base64 xla.OpSharding, not "
            f"{_kind(encoded)}.") from None
    kind = fields.get("memoryKind")
    if kind is not None and (not isinstance(kind, str) or not kind):
        raise errors.InvalidRequest(
            f"{where}.memory_kind must be a memory kind's name, not {kind!r}.")
    return sh.Sharding(sh.ShardingKind.HLO, tuple(DeviceId(d) for d in devices), kind,
                       op_sharding)


def _check_op_sharding(schema: Schema, sharding: sh.Sharding, where: str) -> None:
    """Refuses an OpSharding that does not parse or does not fit its device list. Shapes
    come with the arrays; this checks it at the least rank it tiles."""
    try:
        proto = schema["xla.OpSharding"].FromString(sharding.op_sharding)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise errors.InvalidRequest(
            f"{where}.xla_hlo_sharding does not parse as an xla.OpSharding ({e}).") from None
    if proto.type == _TUPLE:
        raise errors.InvalidRequest(
            f"{where}.xla_hlo_sharding is a tuple sharding; give one sharding per array.")
    rank = max(0, len(proto.tile_assignment_dimensions) - len(proto.last_tile_dims)
               - int(proto.replicate_on_last_tile_dim))
    try:
        sh.shard_boxes(sharding, (1,) * rank)
    except errors.IsthmusError as e:
        raise errors.InvalidRequest(f"{where}.xla_hlo_sharding: {e.message}") from None


def _kind(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
