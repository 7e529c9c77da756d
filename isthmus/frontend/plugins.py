"""Plugin programs: the JSON programs pathwaysutils (and isthmus.shared) compile, routed by
kind to the module that parses and plans them.

A `PluginProgram`'s data is `__serialized_plugin_program ` and a JSON object whose one key
names its kind: `reshardRequest` (`frontend/reshard.py`), `profileRequest`
(`frontend/profile.py`), the persistence requests and a shared service's keep and take
(`frontend/persistence.py`). Anything else is UNIMPLEMENTED, naming its keys.
"""

from __future__ import annotations

import json

from isthmus import errors
from isthmus.controller.executables import Executable
from isthmus.controller.session_checkpoints import PersistencePlan
from isthmus.controller.session_kept import KeepPlan
from isthmus.controller.session_moves import ReshardPlan
from isthmus.controller.session_profiles import ProfilePlan
from isthmus.frontend import persistence, profile, reshard
from isthmus.frontend.message import Message
from isthmus.frontend.session import FrontendSession

PREFIX = b"__serialized_plugin_program "


def plan_of(data: bytes) -> ReshardPlan | ProfilePlan | PersistencePlan | KeepPlan:
    """The plan of a plugin program's bytes; InvalidRequest/Unimplemented naming the field."""
    if not data.startswith(PREFIX):
        raise errors.InvalidRequest("the PluginProgram does not start with "
                                    "'__serialized_plugin_program '; send one from jax.")
    try:
        request = json.loads(data[len(PREFIX):])
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise errors.InvalidRequest(f"the plugin program is not JSON ({e}).") from None
    if not isinstance(request, dict):
        raise errors.InvalidRequest("the plugin program must be a JSON object.")
    if "reshardRequest" in request:
        return reshard.plan_of(request["reshardRequest"])
    if "profileRequest" in request:
        return profile.plan_of(request["profileRequest"])
    plan = persistence.plan_of(request)
    if plan is not None:
        return plan
    raise errors.Unimplemented(
        f"plugin programs {sorted(request)[:4]} are not supported; isthmus serves "
        "pathwaysutils' persistence requests (persistenceWriteRequest, persistenceReadRequest "
        "and their bulk forms).")


def compile_plugin(session: FrontendSession, program: Message) -> Executable:
    """Starts a Compile of a PluginProgram: the session's executable for its plan."""
    plan = plan_of(bytes(program.data))
    if isinstance(plan, ReshardPlan):
        return reshard.compile_reshard(session, plan)
    if isinstance(plan, ProfilePlan):
        return profile.compile_profile(session, plan)
    return persistence.compile_plan(session, plan)
