"""Requests the stock jax client rarely sends, driven at the protocol level and checked
against numpy: ReshardArrays, BitcastArrays, RemapArrays, sharded host-buffer uploads."""

import numpy as np
import pytest

from tests.integration.rawclient import RawSession, compile_add_one, status_of

OTHER = 3  # xla.OpSharding.Type.OTHER (tiled)


def _tiled(raw, device_ids, tiles):
    op = raw.s["xla.OpSharding"](type=OTHER, tile_assignment_dimensions=tiles,
                                 tile_assignment_devices=list(range(len(device_ids))))
    hlo = raw.s["xla.ifrt.HloShardingProto"](xla_op_sharding=op)
    hlo.devices.device_ids.extend(device_ids)
    sharding = raw.s["xla.ifrt.ShardingProto"]()
    sharding.serialized_sharding.type_name = "xla::ifrt::HloSharding"
    sharding.serialized_sharding.data = hlo.SerializeToString()
    return sharding


def _spec(raw, kind, shape, sharding):
    spec = raw.s["xla.ifrt.ArraySpecProto"]()
    spec.dtype.kind = raw.s["xla.ifrt.DTypeProto"].Kind.Value(kind)
    spec.shape.dims.extend(shape)
    spec.sharding.CopyFrom(sharding)
    return spec


def _upload(raw, handle, x, sharding):
    raw.store(handle, x.tobytes())
    body = raw.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=handle,
                   array_handle=handle)
    body.dtype.kind = raw.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend(x.shape)
    body.sharding.CopyFrom(sharding)
    assert not status_of(raw.call("make_array_from_host_buffer_request", body))[0]


def _read(raw, handle, dtype, shape, buffer_handle):
    copy = raw.msg("CopyToHostBufferRequest", array_handle=handle,
                   host_buffer_handle=buffer_handle)
    code, message = status_of(raw.call("copy_to_host_buffer_request", copy))
    assert code == 0, message
    return np.frombuffer(raw.lookup(buffer_handle), dtype).reshape(shape)


@pytest.fixture
def raw(server):
    with RawSession(server.address) as session:
        yield session


def test_sharded_upload_and_disassemble(raw):
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    _upload(raw, 1, x, _tiled(raw, [4, 5, 6, 7], [2, 2]))
    parts = raw.call("disassemble_into_single_device_arrays_request", raw.msg(
        "DisassembleIntoSingleDeviceArraysRequest", array_handle=1,
        result_handles=[11, 12, 13, 14]))
    assert not status_of(parts)[0]
    expected = [x[:4, :3], x[:4, 3:], x[4:, :3], x[4:, 3:]]
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(_read(raw, 11 + i, np.float32, (4, 3), 100 + i), want)


def test_reshard_to_other_devices_and_tiling(raw):
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    _upload(raw, 1, x, _tiled(raw, [0, 1, 2, 3], [4, 1]))
    body = raw.msg("ReshardArraysRequest", array_handles=[1], result_handles=[2],
                   copy_semantics=2)
    body.array_specs.append(_spec(raw, "KIND_F32", [8, 4], _tiled(raw, [6, 7], [1, 2])))
    assert not status_of(raw.call("reshard_arrays_request", body))[0]
    np.testing.assert_array_equal(_read(raw, 2, np.float32, (8, 4), 50), x)
    raw.call("disassemble_into_single_device_arrays_request", raw.msg(
        "DisassembleIntoSingleDeviceArraysRequest", array_handle=2, result_handles=[3, 4]))
    np.testing.assert_array_equal(_read(raw, 3, np.float32, (8, 2), 51), x[:, :2])
    np.testing.assert_array_equal(_read(raw, 4, np.float32, (8, 2), 52), x[:, 2:])


def test_bitcast_keeps_bytes(raw):
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    sharding = _tiled(raw, [2], [1, 1])
    _upload(raw, 1, x, sharding)
    body = raw.msg("BitcastArraysRequest", array_handles=[1], result_handles=[2],
                   copy_semantics=2)
    body.array_specs.append(_spec(raw, "KIND_S32", [4, 3], sharding))
    assert not status_of(raw.call("bitcast_arrays_request", body))[0]
    np.testing.assert_array_equal(_read(raw, 2, np.int32, (4, 3), 9),
                                  x.view(np.int32).reshape(4, 3))
    bad = raw.msg("BitcastArraysRequest", array_handles=[1], result_handles=[3],
                  copy_semantics=2)
    bad.array_specs.append(_spec(raw, "KIND_S64", [4, 3], sharding))
    raw.call("bitcast_arrays_request", bad)
    code, message = status_of(raw.call("check_value_ready_request", raw.msg(
        "CheckValueReadyRequest", value_handles=[3])))
    assert code != 0 and "size" in message


def test_remap_moves_shards_between_arrays(raw):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = -np.arange(8, dtype=np.float32).reshape(2, 4)
    _upload(raw, 1, a, _tiled(raw, [0, 1], [2, 1]))
    _upload(raw, 2, b, _tiled(raw, [2, 3], [2, 1]))
    plan = raw.s["xla.ifrt.RemapPlanProto"]()
    plan.input_specs.append(_spec(raw, "KIND_F32", [2, 4], _tiled(raw, [0, 1], [2, 1])))
    plan.input_specs.append(_spec(raw, "KIND_F32", [2, 4], _tiled(raw, [2, 3], [2, 1])))
    plan.output_specs.append(_spec(raw, "KIND_F32", [4, 4], _tiled(raw, [0, 1, 2, 3], [4, 1])))
    plan.mappings.add(in_array=0, out_array=0, from_start=[0], from_end=[2], from_step=[1],
                      to_start=[0], to_end=[2], to_step=[1])
    plan.mappings.add(in_array=1, out_array=0, from_start=[0], from_end=[2], from_step=[1],
                      to_start=[2], to_end=[4], to_step=[1])
    body = raw.msg("RemapArraysRequest", array_handles=[1, 2], result_handles=[3],
                   copy_semantics=3)
    body.plan.CopyFrom(plan)
    code, message = status_of(raw.call("remap_arrays_request", body))
    assert code == 0, message
    np.testing.assert_array_equal(_read(raw, 3, np.float32, (4, 4), 7), np.concatenate([a, b]))



def test_execute_with_fill_status_and_execute_results(raw):
    exe = compile_add_one(raw)
    _upload(raw, 1, np.arange(4, dtype=np.float32), _tiled(raw, [0], [1]))
    first = raw.msg("LoadedExecutableExecuteRequest", loaded_executable_handle=exe,
                    args_handles=[1])
    first.execute_options.fill_status = True
    reply = raw.call("loaded_executable_execute_request", first)
    out = reply.loaded_executable_execute_response
    assert not status_of(reply)[0] and len(out.outputs) == 1 and out.status_handle
    fetched = raw.call("loaded_executable_fetch_execute_result_request", raw.msg(
        "LoadedExecutableFetchExecuteResultRequest", result_status_handle=out.status_handle))
    assert not status_of(fetched)[0]
    np.testing.assert_array_equal(_read(raw, out.outputs[0].array_handle, np.float32, (4,), 60),
                                  np.arange(4) + 1)
    # Later calls: client-minted result and status handles, an empty but present answer.
    later = raw.msg("LoadedExecutableExecuteRequest", loaded_executable_handle=exe,
                    args_handles=[out.outputs[0].array_handle], result_array_handle=[70],
                    result_status_handle=71)
    later.execute_options.fill_status = True
    reply = raw.call("loaded_executable_execute_request", later)
    assert reply.HasField("loaded_executable_execute_response")
    assert not reply.loaded_executable_execute_response.outputs
    done = raw.call("check_future_request", raw.msg("CheckFutureRequest", future_handle=71))
    assert not status_of(done)[0]
    np.testing.assert_array_equal(_read(raw, 70, np.float32, (4,), 61), np.arange(4) + 2)
    # Without fill_status the first answer must carry no status handle (the client aborts).
    exe2 = compile_add_one(raw)
    plain = raw.call("loaded_executable_execute_request", raw.msg(
        "LoadedExecutableExecuteRequest", loaded_executable_handle=exe2, args_handles=[70]))
    assert plain.loaded_executable_execute_response.status_handle == 0
    # A failing later call binds its handles to the error.
    bad = raw.msg("LoadedExecutableExecuteRequest", loaded_executable_handle=exe,
                  args_handles=[999], result_array_handle=[80], result_status_handle=81)
    bad.execute_options.fill_status = True
    assert status_of(raw.call("loaded_executable_execute_request", bad))[0] == 5
    code, message = status_of(raw.call("check_future_request",
                                       raw.msg("CheckFutureRequest", future_handle=81)))
    assert code == 5 and "999" in message
    code, _ = status_of(raw.call("check_value_ready_request",
                                 raw.msg("CheckValueReadyRequest", value_handles=[80])))
    assert code == 5


def test_default_device_assignment_and_layout(raw):
    reply = raw.call("get_default_device_assignment_request", raw.msg(
        "GetDefaultDeviceAssignmentRequest", num_replicas=2, num_partitions=3))
    assignment = reply.get_default_device_assignment_response.device_assignment
    assert (assignment.replica_count, assignment.computation_count) == (2, 3)
    assert [list(c.replica_device_ids) for c in assignment.computation_devices] == [
        [0, 1], [2, 3], [4, 5]]
    too_many = raw.call("get_default_device_assignment_request", raw.msg(
        "GetDefaultDeviceAssignmentRequest", num_replicas=8, num_partitions=8))
    assert status_of(too_many)[0] == 3
