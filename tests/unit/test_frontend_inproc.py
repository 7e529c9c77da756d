"""The front end and controller driven in-process: no sockets, one embedded worker."""

import asyncio

import numpy as np

from isthmus.controller.controller import Controller, ControllerConfig
from isthmus.frontend.service import Frontend
from isthmus.head import embedded_fleet
from isthmus.protocol.schema import schema


def _session(fleet=None, validate=False):
    """A front end over `fleet` (default: an embedded one of 2 CPU devices), and a session."""
    fleet = fleet if fleet is not None else embedded_fleet(2)[0]
    frontend = Frontend(Controller(fleet, ControllerConfig(host_buffer_timeout=1,
                                                           validate=validate)), schema())
    metadata = schema()["xla.ifrt.proxy.GrpcIfrtSessionMetadata"]()
    metadata.version.protocol_version = 25
    metadata.version.ifrt_serdes_version_number = 3
    sent = []
    session = frontend.open_session(metadata.SerializeToString(), sent.append)
    return frontend, session, sent


def _request(op_id, kind, **fields):
    request = schema()["xla.ifrt.proxy.IfrtRequest"]()
    request.request_metadata.op_id = op_id
    body = getattr(request, kind)
    body.SetInParent()
    for name, value in fields.items():
        target = getattr(body, name)
        if hasattr(target, "CopyFrom"):
            target.CopyFrom(value)
        elif hasattr(target, "extend"):
            target.extend(value)
        else:
            setattr(body, name, value)
    return request


def _one_device(device_id):
    """An HloSharding on one device, as the client sends it."""
    s = schema()
    sharding = s["xla.ifrt.ShardingProto"]()
    hlo = s["xla.ifrt.HloShardingProto"]()
    hlo.devices.device_ids.append(device_id)
    hlo.xla_op_sharding.SetInParent()
    sharding.serialized_sharding.type_name = "xla::ifrt::HloSharding"
    sharding.serialized_sharding.data = hlo.SerializeToString()
    return sharding


async def _put(session, sent, op_id, handle, data):
    """Uploads `data` (int32) to device 0 as array `handle`; the response."""
    s = schema()
    session.host_buffers.begin(op_id, data.nbytes)
    session.host_buffers.complete(op_id, memoryview(bytearray(data.tobytes())))
    session.handle(_request(
        op_id, "make_array_from_host_buffer_request",
        dtype=s["xla.ifrt.DTypeProto"](kind=s["xla.ifrt.DTypeProto"].KIND_S32),
        shape=s["xla.ifrt.ShapeProto"](dims=list(data.shape)), sharding=_one_device(0),
        host_buffer_handle=op_id, array_handle=handle))
    for _ in range(200):
        answers = [r for r in sent if r.response_metadata.op_id == op_id]
        if answers:
            return answers[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no answer to request {op_id}")


def test_upload_and_download_through_the_front_end():
    async def main():
        frontend, session, sent = _session()
        session.handle(_request(1, "init_request"))
        init = sent[-1].init_response
        assert [d.id for d in init.all_devices] == [0, 1]
        assert init.all_devices[1].attributes.attributes["slice_index"].int64_value == 0
        s = schema()
        sharding = s["xla.ifrt.ShardingProto"]()
        hlo = s["xla.ifrt.HloShardingProto"]()
        hlo.devices.device_ids.append(1)
        hlo.xla_op_sharding.SetInParent()
        sharding.serialized_sharding.type_name = "xla::ifrt::HloSharding"
        sharding.serialized_sharding.data = hlo.SerializeToString()
        data = np.arange(6, dtype=np.int32)
        session.handle(_request(
            2, "make_array_from_host_buffer_request",
            dtype=s["xla.ifrt.DTypeProto"](kind=s["xla.ifrt.DTypeProto"].KIND_S32),
            shape=s["xla.ifrt.ShapeProto"](dims=[2, 3]), sharding=sharding,
            host_buffer_handle=9, array_handle=9))
        session.host_buffers.begin(9, data.nbytes)
        session.host_buffers.complete(9, memoryview(bytearray(data.tobytes())))
        session.handle(_request(3, "copy_to_host_buffer_request", array_handle=9,
                                host_buffer_handle=10))
        for _ in range(100):
            if any(r.response_metadata.op_id == 3 for r in sent):
                break
            await asyncio.sleep(0.01)
        reply = [r for r in sent if r.response_metadata.op_id == 3][0]
        assert reply.response_metadata.status.code == 0, reply
        assert bytes(await session.host_buffers.lookup(10)) == data.tobytes()
        # A failed request binds its client handle to the error.
        session.handle(_request(4, "fully_replicated_shard_request", array_handle=77,
                                result_handle=78))
        assert sent[-1].response_metadata.status.code == 5
        session.handle(_request(5, "check_value_ready_request", value_handles=[78]))
        assert "77" in sent[-1].response_metadata.status.message
        await session.close()
        assert frontend.controller.ledger.accounting()[0] == {"buffers": 0, "bytes": 0}
    asyncio.run(main())


def test_host_buffers_of_a_refused_sharded_put_are_freed():
    s = schema()
    dtype = s["xla.ifrt.DTypeProto"]

    def sharded_put(op_id, first, specs):
        """A MakeArraysFromHostBufferShards of 4 int32 over devices 0 and 1; `specs` gives
        each spec's (shard indices, host dtype kind) per host buffer."""
        sharding = s["xla.ifrt.ShardingProto"]()
        hlo = s["xla.ifrt.HloShardingProto"]()
        hlo.devices.device_ids.extend([0, 1])
        op = hlo.xla_op_sharding
        op.type = op.OTHER
        op.tile_assignment_dimensions.extend([2])
        op.tile_assignment_devices.extend([0, 1])
        sharding.serialized_sharding.type_name = "xla::ifrt::HloSharding"
        sharding.serialized_sharding.data = hlo.SerializeToString()
        request = _request(op_id, "make_arrays_from_host_buffer_shards_request")
        handle = first
        for buffers in specs:
            spec = request.make_arrays_from_host_buffer_shards_request.specs.add()
            spec.array_spec.dtype.kind = dtype.KIND_S32
            spec.array_spec.shape.dims.extend([4])
            spec.array_spec.sharding.CopyFrom(sharding)
            for index, kind in buffers:
                spec.addressable_shard_indices.add().indices.extend(index)
                spec.host_buffers.add(dtype=dtype(kind=getattr(dtype, f"KIND_{kind}")),
                                      shape=s["xla.ifrt.ShapeProto"](dims=[2]),
                                      host_buffer_handle=handle)
                handle += 1
        return request, range(first, handle)

    async def main():
        frontend, session, sent = _session()
        session.handle(_request(1, "init_request"))
        data = memoryview(np.arange(2, dtype=np.int32).tobytes())

        def upload(handle):
            session.host_buffers.begin(handle, len(data))
            session.host_buffers.complete(handle, memoryview(bytearray(data)))

        def reply(op_id):
            return [r for r in sent if r.response_metadata.op_id == op_id][0]

        # Shard index 0 twice: the array carries the error (the controller refuses it).
        request, handles = sharded_put(2, 20, [[([0], "S32"), ([0], "S32")]])
        upload(handles[0])  # one arrives before the request, one after
        session.handle(request)
        upload(handles[1])
        array = reply(2).make_arrays_from_host_buffer_shards_response.array_handles[0]
        session.handle(_request(3, "check_value_ready_request", value_handles=[array]))
        for _ in range(100):
            if any(r.response_metadata.op_id == 3 for r in sent):
                break
            await asyncio.sleep(0.01)
        assert "given twice" in reply(3).response_metadata.status.message, reply(3)
        assert len(session.host_buffers) == 0 and session.host_buffers.bytes_held == 0
        # A host shard of the wrong dtype in the first of two specs: the request fails, and
        # neither spec's buffers stay.
        request, handles = sharded_put(4, 30, [[([0], "S32"), ([1], "F32")],
                                               [([0], "S32"), ([1], "S32")]])
        upload(handles[0])
        session.handle(request)
        assert "dtype" in reply(4).response_metadata.status.message, reply(4)
        for handle in handles[1:]:
            upload(handle)
        assert len(session.host_buffers) == 0 and session.host_buffers.bytes_held == 0
        await session.close()
    asyncio.run(main())


def test_default_layouts_are_the_serving_backends_own(monkeypatch):
    """A backend whose defaults are not row-major (a TPU's are tiled and often transposed):
    GetDefaultLayout answers its host's layout, asked once per dtype and shape, and an
    upload naming that layout is accepted. CI has no TPU: the host here is jaxlib's CPU
    client under an accelerator's name, its default layouts those of a TPU."""
    import dataclasses

    from isthmus.controller.fleet import WholeFleet
    from isthmus.ids import WorkerId
    from isthmus.worker import platforms

    asked = []

    def tpu_default(device, dtype, shape):
        asked.append((dtype, shape))
        return "{0,1:T(8,128)}" if len(shape) == 2 else "{0:T(512)}"

    monkeypatch.setattr(platforms, "default_layout", tpu_default)

    async def main():
        cpu_fleet, host = embedded_fleet(2)
        _, session, sent = _session(WholeFleet(
            [dataclasses.replace(d, platform="tpu", kind="TPU stand-in")
             for d in cpu_fleet.devices], {WorkerId(0): host}))
        s = schema()
        f32 = s["xla.ifrt.DTypeProto"](kind=s["xla.ifrt.DTypeProto"].KIND_F32)

        async def layout(op_id, dims):
            session.handle(_request(op_id, "get_default_layout_request", dtype=f32,
                                    dims=dims, device_id=1))
            for _ in range(100):
                reply = [r for r in sent if r.response_metadata.op_id == op_id]
                if reply:
                    assert reply[0].response_metadata.status.code == 0, reply[0]
                    return reply[0].get_default_layout_response.serialized_pjrt_layout
                await asyncio.sleep(0.01)
            raise AssertionError(f"no answer to {op_id}")

        assert await layout(1, [512, 10]) == b"{0,1:T(8,128)}"
        assert await layout(2, [512, 10]) == b"{0,1:T(8,128)}"
        assert await layout(3, [512]) == b"{0:T(512)}"
        assert asked == [("float32", (512, 10)), ("float32", (512,))]  # each asked once
        # An upload that names the device's default layout (as the client was told it).
        proto = s["xla.ifrt.PjRtLayoutProto"]()
        from isthmus.frontend.layouts import fill

        fill("{0,1:T(8,128)}", proto.xla_layout)
        assert list(proto.xla_layout.tiles[0].dimensions) == [8, 128]
        named = s["xla.ifrt.LayoutProto"]()
        named.serialized_layout.type_name = "xla::ifrt::PjRtLayout"
        named.serialized_layout.data = proto.SerializeToString()
        sharding = s["xla.ifrt.ShardingProto"]()
        hlo = s["xla.ifrt.HloShardingProto"]()
        hlo.devices.device_ids.append(1)
        hlo.xla_op_sharding.SetInParent()
        sharding.serialized_sharding.type_name = "xla::ifrt::HloSharding"
        sharding.serialized_sharding.data = hlo.SerializeToString()
        session.handle(_request(
            4, "make_array_from_host_buffer_request", dtype=f32,
            shape=s["xla.ifrt.ShapeProto"](dims=[512, 10]), sharding=sharding,
            host_buffer_handle=9, array_handle=9, layout=named))
        reply = [r for r in sent if r.response_metadata.op_id == 4][0]
        assert reply.response_metadata.status.code == 0, reply
        # Another layout is still refused.
        fill("{1,0:T(2,128)}", proto.xla_layout)
        named.serialized_layout.data = proto.SerializeToString()
        session.handle(_request(
            5, "make_array_from_host_buffer_request", dtype=f32,
            shape=s["xla.ifrt.ShapeProto"](dims=[512, 10]), sharding=sharding,
            host_buffer_handle=11, array_handle=11, layout=named))
        reply = [r for r in sent if r.response_metadata.op_id == 5][0]
        assert reply.response_metadata.status.code == 12, reply  # UNIMPLEMENTED
        await session.close()
    asyncio.run(main())


def test_layouts_keep_their_tiles():
    from isthmus.frontend.layouts import COMBINE, fill

    proto = schema()["xla.LayoutProto"]()
    fill("{1,0:T(8,128)(2,1)E(4)S(1)}", proto)
    assert list(proto.minor_to_major) == [1, 0]
    assert [list(t.dimensions) for t in proto.tiles] == [[8, 128], [2, 1]]
    assert proto.element_size_in_bits == 4 and proto.memory_space == 1
    scalar = schema()["xla.LayoutProto"]()
    fill("{:T(128)}", scalar)
    assert list(scalar.minor_to_major) == [] and list(scalar.tiles[0].dimensions) == [128]
    combined = schema()["xla.LayoutProto"]()
    fill("{0:T(2,*)L(1024)}", combined)
    assert list(combined.tiles[0].dimensions) == [2, COMBINE]
    plain = schema()["xla.LayoutProto"]()
    fill("{2,1,0}", plain)
    assert list(plain.minor_to_major) == [2, 1, 0] and not plain.tiles


def test_a_tpus_coordinates_reach_the_client_as_device_attributes():
    """jax builds a TPU's meshes from its devices' `coords` and `core_on_chip`: Init carries
    what the backend said of each device (`Device.attributes`), integers and lists alike."""
    import dataclasses

    from isthmus.controller.fleet import WholeFleet
    from isthmus.ids import WorkerId
    from isthmus.transport import messages as m
    from isthmus.worker.platforms import device_attributes

    class Chip:
        coords = [1, 0, 0]
        core_on_chip = 0
        device_kind = "TPU v5 lite"

    assert device_attributes(Chip()) == (("coords", (1, 0, 0)), ("core_on_chip", 0))
    assert device_attributes(object()) == ()
    register = m.Register(1, 0, 1, "tpu", "TPU v5 lite", "unix:/x", "h", 1,
                          device_attributes=(device_attributes(Chip()),))
    assert m.decode(m.encode(register)).device_attributes[0][0][0] == "coords"

    async def main():
        cpu_fleet, host = embedded_fleet(2)
        _, session, sent = _session(WholeFleet(
            [dataclasses.replace(d, platform="tpu", kind="TPU v5 lite",
                                 attributes=device_attributes(Chip()))
             for d in cpu_fleet.devices], {WorkerId(0): host}))
        session.handle(_request(1, "init_request"))
        device = sent[-1].init_response.all_devices[0]
        attributes = device.attributes.attributes
        assert list(attributes["coords"].int64_list_value.elements) == [1, 0, 0]
        assert attributes["core_on_chip"].int64_value == 0
        assert attributes["slice_index"].int64_value == 0
        await session.close()
    asyncio.run(main())


def test_a_client_handle_in_the_servers_own_range_is_refused():
    """Handles from 2**62 on are the server's (`SERVER_HANDLE_BASE`), as in XLA's server: a
    client's array handle there could later be handed out again for another array."""
    from isthmus.frontend.session import SERVER_HANDLE_BASE

    async def main():
        frontend, session, sent = _session()
        session.handle(_request(1, "init_request"))
        data = np.arange(4, dtype=np.int32)
        refused = await _put(session, sent, 2, SERVER_HANDLE_BASE, data)
        assert refused.response_metadata.status.code == 3, refused
        assert "range this server mints" in refused.response_metadata.status.message
        assert SERVER_HANDLE_BASE not in session.arrays  # nothing bound to it, not even the error
        assert (await _put(session, sent, 3, 7, data)).response_metadata.status.code == 0
        assert frontend.controller.ledger.accounting()[0]["buffers"] == 1  # the refused is freed
        await session.close()
    asyncio.run(main())


def test_a_programs_outputs_are_bound_at_once_and_a_handle_in_use_refused():
    """`bind_arrays` (a program's outputs): fresh handles bind together; one already in use
    is refused as `bind_array` refuses it, the outputs before it stay bound (the client
    holds them) and it and those after it are released."""
    import pytest

    from isthmus import errors

    async def main():
        frontend, session, sent = _session()
        session.handle(_request(1, "init_request"))
        await _put(session, sent, 2, 10, np.arange(4, dtype=np.int32))
        source = session.arrays[10]
        ledger = frontend.controller.ledger

        def views(n):
            return [session.ctl.arrays.share(source.dtype, source.shape, source.sharding,
                                             source.shards) for _ in range(n)]

        first = views(2)
        session.bind_arrays([20, 21], first)
        assert [session.arrays[20], session.arrays[21]] == first
        second = views(3)
        with pytest.raises(errors.InvalidRequest, match="handle 21 is already in use"):
            session.bind_arrays([22, 21, 23], second)
        assert session.arrays[22] is second[0] and session.arrays[21] is first[1]
        assert 23 not in session.arrays
        assert ledger.holds(second[0])
        assert not ledger.holds(second[1]) and not ledger.holds(second[2])
        await session.close()
    asyncio.run(main())


def test_validate_mode_fails_the_request_that_broke_the_records(caplog):
    """`--validate`: after each request the handles the client minted for its results are
    bound and the ledger's records agree, or that request fails with INTERNAL, logged as
    'isthmus validate:' (which fails a test's LocalServer at its stop)."""
    import dataclasses

    async def main():
        frontend, session, sent = _session(validate=True)
        session.handle(_request(1, "init_request"))
        assert sent[-1].response_metadata.status.code == 0
        # A handler that answers without binding the result handle it was given.
        kind = "fully_replicated_shard_request"
        session._handlers = dict(session._handlers)
        session._handlers[kind] = dataclasses.replace(
            session._handlers[kind], handler=lambda session, request, response: None)
        session.handle(_request(2, kind, array_handle=5, result_handle=6))
        status = sent[-1].response_metadata.status
        assert status.code == 13 and "without binding the array handles [6]" in status.message
        # An array's group whose count of holders is off by one.
        answer = await _put(session, sent, 3, 9, np.arange(4, dtype=np.int32))
        assert answer.response_metadata.status.code == 0
        group = session.arrays[9].group
        group.refs += 1
        session.handle(_request(4, "init_request"))
        status = sent[-1].response_metadata.status
        assert status.code == 13 and "records disagree" in status.message, status
        group.refs -= 1
        # The executables' records: more idle than the cache keeps.
        config = frontend.controller.config
        frontend.controller.config = dataclasses.replace(config, compile_cache_size=-1)
        session.handle(_request(5, "init_request"))
        status = sent[-1].response_metadata.status
        assert status.code == 13 and "idle executables" in status.message, status
        frontend.controller.config = config
        await session.close()
    asyncio.run(main())
    assert any("isthmus validate:" in r.getMessage() for r in caplog.records)


def test_validate_mode_at_stop_compares_each_hosts_buffers_with_the_ledger(caplog):
    """`--validate`, at stop with every session closed: a buffer a host holds that the
    controller freed (a leak), and one the controller has not freed that the host lacks, are
    reported per host (`Controller.validate_hosts`) and logged by the head as
    'isthmus validate:'; a host that agrees gives nothing."""
    from isthmus.head import Head, HeadConfig
    from isthmus.ids import BufferId

    async def main():
        fleet, host = embedded_fleet(2)
        frontend, session, sent = _session(fleet, validate=True)
        session.handle(_request(1, "init_request"))
        answer = await _put(session, sent, 2, 7, np.arange(4, dtype=np.int32))
        assert answer.response_metadata.status.code == 0
        controller = frontend.controller
        assert await controller.validate_hosts() == (1, [])
        kept = session.arrays[7].group.base
        await host.put(BufferId(900), 1, np.arange(2, dtype=np.int32))  # not the ledger's
        host.free([BufferId(kept)])  # the ledger's, gone from the host
        answered, problems = await controller.validate_hosts(wait=0.2)
        assert answered == 1 and problems == [
            "host 0 still holds 1 buffers the controller freed: [900]",
            f"host 0 lacks 1 buffers the controller has not freed: [{kept}]"], problems
        await frontend.close()  # the session's array freed: the host's [900] is left
        head = Head(HeadConfig(devices=2))
        head.frontend = frontend
        await head._validate_hosts(wait=0.2)
        await host.close()

    asyncio.run(main())
    found = [r.getMessage() for r in caplog.records if "isthmus validate:" in r.getMessage()]
    assert found == ["isthmus validate: at stop, every session closed, host 0 still holds 1 "
                     "buffers the controller freed: [900]"], found


def test_a_readiness_check_of_computed_arrays_is_answered_in_the_call_that_handles_it():
    """The embedded host answers a readiness check of a computed array at once
    (`reads.settle_on` settles from an answer already in), and the session answers a request
    whose work is done already in the call that handles it: no task, no turn of the event
    loop (a jit and its wait took 4.45 turns, now 3.25). In validate mode the records are
    checked after it, as after an answer that comes later."""
    async def main():
        frontend, session, sent = _session(validate=True)
        session.handle(_request(1, "init_request"))
        put = await _put(session, sent, 2, 20, np.arange(4, dtype=np.int32))
        assert put.response_metadata.status.code == 0, put
        await asyncio.sleep(0.05)  # the host has stored it
        before = len(sent)
        session.handle(_request(3, "check_value_ready_request", value_handles=[20]))
        assert len(sent) == before + 1  # answered before handle returned
        assert sent[-1].response_metadata.op_id == 3
        assert sent[-1].response_metadata.status.code == 0, sent[-1]
        assert sent[-1].HasField("check_value_ready_response")
        await session.close()
    asyncio.run(asyncio.wait_for(main(), 60))
