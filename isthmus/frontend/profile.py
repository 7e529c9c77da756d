"""pathwaysutils' profile program: a JSON plugin program that starts, then stops, a profile.

`pathwaysutils.profiling.start_trace` (and so `jax.profiler.start_trace` and
`jax.profiler.trace` after `pathwaysutils.initialize()`) sends a `PluginProgram` whose JSON
is `{"profileRequest": {...}}` with

    traceLocation            the log directory (pathwaysutils allows only gs:// locations)
    maxNumHosts              how many hosts to profile (pathwaysutils' default: 1)
    includeResourceManagers  the controller's own trace too
    maxDurationSecs          optional: the profile stops by itself after this long
    xprofTraceOptions        optional (jax >= 0.9.2): traceDirectory, hostTraceLevel,
                             traceSessionName (the run directory's name) and
                             pwTraceOptions {enablePythonTracer, advancedConfiguration}

and calls the compiled program twice: start, then stop. With `xprofTraceOptions` each call
returns one string array on the default device. The front end checks the request and hands
the session a `ProfilePlan` (`controller/session_profiles.py` runs it).
"""

from __future__ import annotations

import math
import re

from isthmus import errors
from isthmus.controller.executables import Executable
from isthmus.controller.session_profiles import ProfilePlan
from isthmus.frontend.session import FrontendSession
from isthmus.transport.records import TraceOptions

_RUN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_ADVANCED_KINDS = ("boolValue", "int64Value", "stringValue")


def plan_of(body: object) -> ProfilePlan:
    """The plan of a `profileRequest`; InvalidRequest naming the field that is wrong."""
    if not isinstance(body, dict):
        raise errors.InvalidRequest("profileRequest must be a JSON object.")
    xprof = body.get("xprofTraceOptions")
    if xprof is not None and not isinstance(xprof, dict):
        raise errors.InvalidRequest("profileRequest.xprofTraceOptions must be a JSON object.")
    location = body.get("traceLocation") or (xprof or {}).get("traceDirectory")
    if not isinstance(location, str) or not location.strip():
        raise errors.InvalidRequest("profileRequest needs a traceLocation (the log directory "
                                    "the profile is written to).")
    max_hosts = body.get("maxNumHosts", 1)
    if isinstance(max_hosts, bool) or not isinstance(max_hosts, int) or max_hosts < 1:
        raise errors.InvalidRequest(f"profileRequest.maxNumHosts is {max_hosts!r}; give a "
                                    "positive number of hosts to profile.")
    controller = body.get("includeResourceManagers", False)
    if not isinstance(controller, bool):
        raise errors.InvalidRequest("profileRequest.includeResourceManagers must be true or "
                                    "false.")
    duration = body.get("maxDurationSecs")
    if duration is not None and (isinstance(duration, bool) or
                                 not isinstance(duration, (int, float)) or
                                 not math.isfinite(duration) or duration <= 0):
        raise errors.InvalidRequest(f"profileRequest.maxDurationSecs is {duration!r}; give a "
                                    "positive number of seconds.")
    run, options = _xprof(xprof) if xprof is not None else (None, TraceOptions())
    return ProfilePlan(location.strip(), max_hosts, controller, run, xprof is not None,
                       options, None if duration is None else float(duration))


def _xprof(xprof: dict[str, object]) -> tuple[str | None, TraceOptions]:
    run = xprof.get("traceSessionName")
    if run is not None and (not isinstance(run, str) or not _RUN_NAME.fullmatch(run)
                            or run in (".", "..")):
        raise errors.InvalidRequest(
            f"xprofTraceOptions.traceSessionName is {run!r}; a run name is 1 to 200 letters, "
            "digits, '_', '-' or '.'.")
    level = xprof.get("hostTraceLevel", 2)
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 3:
        raise errors.InvalidRequest(f"xprofTraceOptions.hostTraceLevel is {level!r}; give 0 "
                                    "to 3.")
    pathways = xprof.get("pwTraceOptions", {})
    if not isinstance(pathways, dict):
        raise errors.InvalidRequest("xprofTraceOptions.pwTraceOptions must be a JSON object.")
    python = pathways.get("enablePythonTracer", False)
    if not isinstance(python, bool):
        raise errors.InvalidRequest("pwTraceOptions.enablePythonTracer must be true or false.")
    return run or None, TraceOptions(level, int(python),
                                     _advanced(pathways.get("advancedConfiguration", {})))


def _advanced(config: object) -> tuple[tuple[str, bool | int | str], ...]:
    """`advancedConfiguration` ({name: {"boolValue" | "int64Value" | "stringValue": v}}) as
    (name, bool | int | str) pairs for jax's `ProfileOptions.advanced_configuration`."""
    if not isinstance(config, dict):
        raise errors.InvalidRequest("pwTraceOptions.advancedConfiguration must be a JSON "
                                    "object.")
    pairs: list[tuple[str, bool | int | str]] = []
    for name, wrapped in config.items():
        kinds = [k for k in _ADVANCED_KINDS if isinstance(wrapped, dict) and k in wrapped]
        if len(kinds) != 1 or len(wrapped) != 1:
            raise errors.InvalidRequest(
                f"advancedConfiguration[{name!r}] must hold exactly one of {_ADVANCED_KINDS}.")
        value = wrapped[kinds[0]]
        try:
            if kinds[0] == "boolValue" and isinstance(value, bool):
                pairs.append((name, value))
            elif kinds[0] == "int64Value" and not isinstance(value, bool):
                number = int(value)  # protobuf's JSON writes int64 as a string
                if not -2**63 <= number < 2**63:
                    raise ValueError(value)
                pairs.append((name, number))
            elif kinds[0] == "stringValue" and isinstance(value, str):
                pairs.append((name, value))
            else:
                raise ValueError(value)
        except (TypeError, ValueError):
            raise errors.InvalidRequest(f"advancedConfiguration[{name!r}] holds {value!r}, "
                                        f"not a {kinds[0]}.") from None
    return tuple(pairs)


def compile_profile(session: FrontendSession, plan: ProfilePlan) -> Executable:
    """Starts a Compile of a profile program: the session's executable for the plan."""
    return session.ctl.profiles.compile(plan)

