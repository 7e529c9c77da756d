"""Array requests that make arrays from arrays, move them, or end them."""

from __future__ import annotations

from collections.abc import Iterable

from isthmus import errors
from isthmus.controller.arrays import Array
from isthmus.frontend.message import Message
from isthmus.frontend.serdes import ArraySpec
from isthmus.frontend.session import FrontendSession

DONATE_INPUT = 3  # xla.ifrt.proto.ArrayCopySemantics.ARRAY_COPY_SEMANTICS_DONATE_INPUT


def _donate(body: Message) -> bool:
    return body.copy_semantics == DONATE_INPUT


def _bind_all(session: FrontendSession, handles_in: Iterable[int], arrays: list[Array],
              out: list[int]) -> None:
    handles_in = list(handles_in)
    if handles_in and len(handles_in) != len(arrays):
        session.ctl.arrays.release(arrays)
        raise errors.InvalidRequest(
            f"the request gives {len(handles_in)} result handles for {len(arrays)} results.")
    for index, array in enumerate(arrays):
        out.append(session.bind_array(handles_in[index] if handles_in else None, array))


def assemble(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.assemble_array_from_single_device_arrays_request
    parts = [session.array(h) for h in body.single_device_array_handles]
    if not parts:
        raise errors.InvalidRequest("assembling an array needs at least one single-device array.")
    dtype = session.serdes.dtype(body.dtype) if body.HasField("dtype") else parts[0].dtype
    array = session.ctl.views.assemble(dtype, session.serdes.shape(body.shape),
                                 session.serdes.sharding(body.sharding), parts, _donate(body))
    handle = body.result_handle or None
    response.assemble_array_from_single_device_arrays_response.array_handle = (
        session.bind_array(handle, array))


def disassemble(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.disassemble_into_single_device_arrays_request
    array = session.array(body.array_handle)
    parts = session.ctl.views.disassemble(array, _donate(body))
    _bind_all(session, body.result_handles, parts,
              response.disassemble_into_single_device_arrays_response.array_handles)


def fully_replicated_shard(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.fully_replicated_shard_request
    array = session.ctl.views.fully_replicated_shard(session.array(body.array_handle),
                                                     _donate(body))
    response.fully_replicated_shard_response.array_handle = session.bind_array(
        body.result_handle or None, array)


def copy_arrays(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.copy_arrays_request
    arrays = [session.array(h) for h in body.array_handles]
    memory_kind = body.memory_kind if body.HasField("memory_kind") and body.memory_kind else None
    device_ids = list(body.device_ids) or None  # none given: keep each array's devices
    results = session.ctl.moves.copy_arrays(arrays, device_ids, memory_kind, _donate(body))
    _bind_all(session, body.result_handles, results,
              response.copy_arrays_response.array_handles)


def remap_arrays(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.remap_arrays_request
    plan = body.plan
    serdes = session.serdes
    inputs = [session.array(h) for h in body.array_handles]
    if len(inputs) != len(plan.input_specs):
        raise errors.InvalidRequest(
            f"the remap plan describes {len(plan.input_specs)} inputs but {len(inputs)} arrays "
            "were given.")
    for index, (array, spec_proto) in enumerate(zip(inputs, plan.input_specs)):
        spec = serdes.array_spec(spec_proto)
        if spec.dtype != array.dtype or spec.shape != array.shape:
            raise errors.InvalidRequest(
                f"remap input {index} is {array.dtype.kind}{list(array.shape)} but the plan "
                f"expects {spec.dtype.kind}{list(spec.shape)}.")
    outputs = []
    for spec_proto in plan.output_specs:
        spec = serdes.array_spec(spec_proto)
        outputs.append((spec.dtype, spec.shape, spec.sharding))
    mappings = []
    for m in plan.mappings:
        if not (len(m.from_start) == len(m.from_end) == len(m.from_step) == len(m.to_start)
                == len(m.to_end) == len(m.to_step)):
            raise errors.InvalidRequest("a remap plan mapping has intervals of unequal count.")
        for fs, fe, fp, ts, te, tp in zip(m.from_start, m.from_end, m.from_step,
                                          m.to_start, m.to_end, m.to_step):
            if fp <= 0 or tp <= 0:
                raise errors.InvalidRequest("remap plan intervals need a positive step.")
            mappings.append((m.in_array, m.out_array, range(fs, fe, fp), range(ts, te, tp)))
    results = session.ctl.views.remap(inputs, outputs, mappings, _donate(body))
    _bind_all(session, body.result_handles, results,
              response.remap_arrays_response.array_handles)


def _specs(session: FrontendSession, body: Message, arrays: list[Array]) -> list[ArraySpec]:
    if len(body.array_specs) != len(arrays):
        raise errors.InvalidRequest(
            f"{len(arrays)} arrays but {len(body.array_specs)} array specs; send one spec per "
            "array.")
    return [session.serdes.array_spec(p) for p in body.array_specs]


def reshard_arrays(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.reshard_arrays_request
    arrays = [session.array(h) for h in body.array_handles]
    specs = _specs(session, body, arrays)
    for array, spec in zip(arrays, specs):
        if spec.dtype != array.dtype or spec.shape != array.shape:
            raise errors.InvalidRequest(
                f"resharding keeps dtype and shape, but {array.dtype.kind}{list(array.shape)} "
                f"was asked to become {spec.dtype.kind}{list(spec.shape)}.")
    results = session.ctl.moves.reshard(arrays, [s.sharding for s in specs], _donate(body))
    _bind_all(session, body.result_handles, results,
              response.reshard_arrays_response.array_handles)


def bitcast_arrays(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.bitcast_arrays_request
    arrays = [session.array(h) for h in body.array_handles]
    specs = _specs(session, body, arrays)
    results = session.ctl.moves.bitcast(arrays, [(s.dtype, s.shape, s.sharding) for s in specs],
                                  _donate(body))
    _bind_all(session, body.result_handles, results,
              response.bitcast_arrays_response.array_handles)


def make_error_arrays(session: FrontendSession, request: Message, response: Message) -> None:
    body = request.make_error_arrays_request
    try:
        code = errors.Code(body.error.code or errors.Code.UNKNOWN)
    except ValueError:  # a status code without a name here
        code = errors.Code.UNKNOWN
    error = errors.IsthmusError(body.error.message or "error array made by the client",
                                code=code)
    results = []
    for spec_proto in body.array_specs:
        spec = session.serdes.array_spec(spec_proto)
        results.append(session.ctl.arrays.make_error_array(
            spec.dtype, spec.shape, spec.sharding, error))
    _bind_all(session, body.array_handles, results,
              response.make_error_arrays_response.array_handles)


def delete_array(session: FrontendSession, request: Message, response: Message) -> None:
    # Bad handles do not fail the request; they fail its deletion future (as XLA's server).
    arrays, problems = [], []
    for handle in request.delete_array_request.array_handle:
        try:
            arrays.append(session.array(handle))
        except errors.IsthmusError as e:
            problems.append(e)
    done = session.ctl.arrays.delete(arrays)

    async def wait() -> None:
        await done
        if problems:
            raise problems[0]

    response.delete_array_response.deletion_future_handle = session.add_future(None, wait)


def is_array_deleted(session: FrontendSession, request: Message, response: Message) -> None:
    array = session.array(request.is_array_deleted_request.array_handle)
    response.is_array_deleted_response.deleted = array.is_deleted


def destruct_array(session: FrontendSession, request: Message, response: Message) -> None:
    released = []
    for handle in request.destruct_array_request.array_handle:
        value = session.arrays.pop(handle, None)
        if value is not None and not isinstance(value, errors.IsthmusError):
            released.append(value)
    session.ctl.arrays.release(released)
    response.destruct_array_response.SetInParent()
