"""LoadedExecutableExecute and LoadedExecutableFetchExecuteResult."""

from __future__ import annotations

from collections.abc import Awaitable

from isthmus import errors
from isthmus.frontend.colocated import is_python
from isthmus.frontend.message import Message
from isthmus.frontend.persistence import is_kept, is_persistence
from isthmus.frontend.profile import is_profile
from isthmus.frontend.reshard import is_reshard
from isthmus.frontend.session import FrontendSession


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
    options = body.execute_options
    if is_persistence(executable):
        outputs, status = session.ctl.checkpoints.run(executable, args)
    elif is_reshard(executable):
        outputs, status = session.ctl.moves.run_reshard(
            executable, args, frozenset(int(i) for i in options.non_donatable_input_indices))
    elif is_profile(executable):
        outputs, status = session.ctl.profiles.run(executable, args)
    elif is_kept(executable):
        kept = session.kept() if session.lease is not None else None
        outputs, status = session.ctl.kept.run(executable, args, kept)
    elif is_python(executable):
        # Calls from one client thread (its execution stream) run in order on the hosts.
        outputs, status = session.ctl.python.call(
            executable, args, (int(session.id), int(options.execution_stream_id)))
    else:
        non_donatable = frozenset(int(i) for i in options.non_donatable_input_indices)
        outputs, status = session.ctl.programs.execute(executable, args, non_donatable)
    out = response.loaded_executable_execute_response
    if body.result_array_handle:
        if len(body.result_array_handle) != len(outputs):
            session.ctl.arrays.release(outputs)
            raise errors.InvalidRequest(
                f"the program has {len(outputs)} outputs but {len(body.result_array_handle)} "
                "result handles were given.")
        for h, array in zip(body.result_array_handle, outputs):
            session.bind_array(h, array)
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
    elif options.fill_status and not body.result_array_handle:
        out.status_handle = session.add_future(None, status)
    out.SetInParent()


def fetch_execute_result(session: FrontendSession, request: Message,
                         response: Message) -> Awaitable[None]:
    handle = request.loaded_executable_fetch_execute_result_request.result_status_handle
    status = session.take_future(handle)
    response.loaded_executable_fetch_execute_result_response.SetInParent()
    return status()
