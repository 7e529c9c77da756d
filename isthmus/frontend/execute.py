"""LoadedExecutableExecute and LoadedExecutableFetchExecuteResult.

An executable runs by its plan's kind (`executables.ProgramPlan`): `RUNNERS` names the runner
of each, and a test checks that every kind has one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType

from isthmus import errors
from isthmus.controller.arrays import Array
from isthmus.controller.executables import Executable
from isthmus.controller.session_checkpoints import PersistencePlan
from isthmus.controller.session_kept import KeepPlan
from isthmus.controller.session_moves import ReshardPlan
from isthmus.controller.session_profiles import ProfilePlan
from isthmus.frontend.message import Message
from isthmus.frontend.session import FrontendSession
from isthmus.transport.records import ColocatedProgram, CompileRequest

# A run's outputs, and what resolves once it has run (the status the client may ask for).
Run = tuple[list[Array], Callable[[], Awaitable[None]]]
# (session, executable, its arguments, the request's execute_options) -> the run
Runner = Callable[[FrontendSession, Executable, Sequence[Array], Message], Run]


def _non_donatable(options: Message) -> frozenset[int]:
    return frozenset(int(i) for i in options.non_donatable_input_indices)


def _program(session: FrontendSession, executable: Executable, args: Sequence[Array],
             options: Message) -> Run:
    return session.ctl.programs.execute(executable, args, _non_donatable(options))


def _python(session: FrontendSession, executable: Executable, args: Sequence[Array],
            options: Message) -> Run:
    # Calls from one client thread (its execution stream) run in order on the hosts.
    return session.ctl.python.call(
        executable, args, (int(session.id), int(options.execution_stream_id)))


def _reshard(session: FrontendSession, executable: Executable, args: Sequence[Array],
             options: Message) -> Run:
    return session.ctl.moves.run_reshard(executable, args, _non_donatable(options))


def _kept(session: FrontendSession, executable: Executable, args: Sequence[Array],
          options: Message) -> Run:
    kept = session.kept() if session.lease is not None else None
    return session.ctl.kept.run(executable, args, kept)


def _profile(session: FrontendSession, executable: Executable, args: Sequence[Array],
             options: Message) -> Run:
    return session.ctl.profiles.run(executable, args)


def _persistence(session: FrontendSession, executable: Executable, args: Sequence[Array],
                 options: Message) -> Run:
    return session.ctl.checkpoints.run(executable, args)


RUNNERS: Mapping[type, Runner] = MappingProxyType({
    CompileRequest: _program,
    ColocatedProgram: _python,
    ReshardPlan: _reshard,
    KeepPlan: _kept,
    ProfilePlan: _profile,
    PersistencePlan: _persistence,
})


def execute(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.loaded_executable_execute_request
    handle = body.loaded_executable_handle
    executable = session.executable(handle)
    if handle in session.deleted_executables:
        raise errors.InvalidRequest(
            "the executable was deleted; compile the program again to run it.")
    if body.device_ids:
        requested = [int(d) for d in body.device_ids]
        if requested != [d.id for d in executable.devices]:
            raise errors.Unimplemented(
                f"running an executable compiled for devices {[d.id for d in executable.devices]}"
                f" on devices {requested} is not supported; compile it for those devices.")
    args = [session.array(h) for h in body.args_handles]
    runner = RUNNERS.get(type(executable.request))
    if runner is None:
        raise errors.InternalError(
            f"no runner for a {type(executable.request).__name__}; this is a bug in isthmus: "
            "please report it.")
    outputs, status = runner(session, executable, args, body.execute_options)
    out = response.loaded_executable_execute_response
    if body.result_array_handle:
        if len(body.result_array_handle) != len(outputs):
            session.ctl.arrays.release(outputs)
            raise errors.InvalidRequest(
                f"the program has {len(outputs)} outputs but {len(body.result_array_handle)} "
                "result handles were given.")
        if len(outputs) == 1:  # the one-output call: no set made
            session.bind_array(body.result_array_handle[0], outputs[0])
        else:
            session.bind_arrays(body.result_array_handle, outputs)
    else:
        for array in outputs:
            entry = out.outputs.add()
            entry.dtype.CopyFrom(session.serdes.dtype_proto(array.dtype))
            entry.shape.CopyFrom(session.serdes.shape_proto(array.shape))
            entry.sharding.CopyFrom(session.serdes.sharding_proto(array.sharding))
            entry.array_handle = session.bind_array(None, array)
    # The client asks for a status only with fill_status; on a first call it aborts if a
    # status handle comes back unasked.
    if body.result_status_handle:
        session.add_future(body.result_status_handle, status)
    elif body.execute_options.fill_status and not body.result_array_handle:
        out.status_handle = session.add_future(None, status)
    out.SetInParent()


def fetch_execute_result(session: FrontendSession, request: Message,
                         response: Message) -> Awaitable[None]:
    handle = request.loaded_executable_fetch_execute_result_request.result_status_handle
    status = session.take_future(handle)
    response.loaded_executable_fetch_execute_result_response.SetInParent()
    return status()
