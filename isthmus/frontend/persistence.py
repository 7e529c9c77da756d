"""pathwaysutils' persistence programs: JSON plugin programs that save or restore arrays
(`frontend/plugins.py` routes a plugin program here by its kind).

pathwaysutils (`pathwaysutils.persistence.helper`, used by orbax when
`ENABLE_PATHWAYS_PERSISTENCE=1`) sends a `PluginProgram` whose data is
`__serialized_plugin_program ` and a JSON object: `persistenceWriteRequest` or
`persistenceReadRequest`, or their bulk forms `bulk_persistence_write_request.write_requests`
and `bulk_persistence_read_request.read_requests`. Each names a base64 location and array
name, a base64 `xla.OpSharding`, the shape (for reads with its XLA primitive type) and the
device ids. The front end checks them and hands the session a `PersistencePlan`. A shared
service's `isthmusKeep`/`isthmusTake` (`isthmus.shared.keep`) name arrays kept at the
location `kept` the same way, and become a `KeepPlan`.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.executables import Executable
from isthmus.controller.session_checkpoints import PersistencePlan, Saved
from isthmus.controller.session_kept import KeepPlan, KeptSpec
from isthmus.frontend.session import FrontendSession
from isthmus.ids import DeviceId

KEPT = "kept"  # the location of arrays kept for a lease's next client (isthmus.shared.keep)


def plan_of(request: dict[str, Any]) -> PersistencePlan | KeepPlan | None:
    """The plan of a plugin program's JSON object, if it is one of these (None: another
    kind); InvalidRequest naming the field."""
    if "persistenceWriteRequest" in request:
        return PersistencePlan(True, (_saved(request["persistenceWriteRequest"], True),))
    if "bulk_persistence_write_request" in request:
        items = _list(request["bulk_persistence_write_request"], "write_requests")
        return PersistencePlan(True, tuple(_saved(r, True) for r in items))
    if "persistenceReadRequest" in request:
        return PersistencePlan(False, (_saved(request["persistenceReadRequest"], False),))
    if "bulk_persistence_read_request" in request:
        items = _list(request["bulk_persistence_read_request"], "read_requests")
        return PersistencePlan(False, tuple(_saved(r, False) for r in items))
    if "isthmusKeep" in request:
        names = request["isthmusKeep"].get("names") if isinstance(
            request["isthmusKeep"], dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise errors.InvalidRequest("isthmusKeep needs a list of array names.")
        return KeepPlan(True, tuple(KeptSpec(f"{KEPT}/{n}") for n in names))
    if "isthmusTake" in request:
        items = _list(request["isthmusTake"], "read_requests")
        specs = [_saved(r, False) for r in items]
        if any(not s.location.startswith(KEPT + "/") for s in specs):
            raise errors.InvalidRequest(f"isthmusTake reads from location {KEPT!r} only.")
        return KeepPlan(False, tuple(KeptSpec(s.location, s.dtype, s.shape, s.sharding)
                                     for s in specs))
    return None


def _list(body: object, field: str) -> list[object]:
    items = body.get(field) if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise errors.InvalidRequest(f"the bulk request needs a non-empty {field!r} list.")
    return items


def _text(body: dict[str, Any], field: str) -> str:
    try:
        return base64.b64decode(body[field], validate=True).decode("utf-8")
    except (KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise errors.InvalidRequest(f"the request's {field!r} is missing or not base64 "
                                    "UTF-8.") from None


def _saved(body: object, write: bool) -> Saved:
    if not isinstance(body, dict):
        raise errors.InvalidRequest("each persistence request must be a JSON object.")
    location, name = _text(body, "b64_location"), _text(body, "b64_name")
    if not location or not name or ".." in name.split("/"):
        raise errors.InvalidRequest(f"the array name {name!r} at {location!r} is not a plain "
                                    "name under its location.")
    try:
        op_sharding = base64.b64decode(body.get("b64_hlo_sharding_string", ""), validate=True)
        device_ids = tuple(DeviceId(int(d)) for d in body["devices"]["device_ids"])
        if write:
            shape, dtype = tuple(int(d) for d in body["shape"]), None
        else:
            info = body["shape"]
            shape = tuple(int(d) for d in info["dimensions"])
            dtype = dtypes.BY_KIND.get("KIND_" + str(info["xla_primitive_type_str"]))
            if dtype is None:
                raise errors.InvalidRequest(
                    f"dtype {info['xla_primitive_type_str']!r} is not supported for reads.")
    except errors.IsthmusError:
        raise
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise errors.InvalidRequest(f"a persistence request lacks a valid field ({e!r}); send "
                                    "one made by pathwaysutils.") from None
    if not device_ids or len(set(device_ids)) != len(device_ids):
        raise errors.InvalidRequest("a persistence request must name each device once.")
    sharding = (sh.Sharding.single(device_ids[0]) if len(device_ids) == 1 else
                sh.Sharding(sh.ShardingKind.HLO, device_ids, None, op_sharding))
    return Saved(f"{location.rstrip('/')}/{name}", dtype, shape,
                 sharding)


def compile_plan(session: FrontendSession, plan: PersistencePlan | KeepPlan) -> Executable:
    """Starts a Compile of a persistence or keep plan: the session's executable for it."""
    for saved in plan.arrays:
        if saved.sharding is not None:
            session.fleet.devices_of(saved.sharding.devices)  # unknown ids: NOT_FOUND now
    if isinstance(plan, KeepPlan):
        return session.ctl.kept.compile(plan)
    return session.ctl.checkpoints.compile(plan)
