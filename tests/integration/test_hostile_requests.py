"""Issue 23: requests with valid handles that crashed, hung or corrupted the server. One
minimal raw-protocol reproduction per defect, asserting the outcome the server owes: a
clean error (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) or the right answer, and a server (and
its workers) still up, still serving the session.

The programs are real jax functions (`fuzz_programs.py`); the fuzzer that found these
cases and keeps looking is `fuzzer.py` (`test_fuzz.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from isthmus.testing import LocalServer
from tests.integration.fuzz_programs import lowered
from tests.integration.rawclient import has_body, status_of
from tests.integration.rawservers import (
    EXHAUSTED,
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID,
    OK,
    Client,
    Servers,
)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


@pytest.fixture
def embedded(servers: Servers) -> LocalServer:
    return servers.get("embedded")


@pytest.fixture(params=["embedded", "fleet"])
def any_server(request: pytest.FixtureRequest, servers: Servers) -> LocalServer:
    return servers.get(request.param)


@pytest.fixture
def client(embedded: LocalServer) -> Iterator[Client]:
    c = Client(embedded)
    yield c
    c.close()


@pytest.fixture
def any_client(any_server: LocalServer) -> Iterator[Client]:
    c = Client(any_server)
    yield c
    c.close()


def _refused(status: tuple[int, str], *codes: int) -> bool:
    return status[0] in codes and "bug in isthmus" not in status[1]


X = np.arange(8, dtype=np.float32)
Y = np.full(8, 10, np.float32)


# ---- 1. sharding mismatch in execute ---------------------------------------------------

@pytest.mark.parametrize("wrong", ["x replicated", "y tiled"])
def test_execute_with_the_wrong_sharding_is_refused(any_client: Client, wrong: str) -> None:
    c = any_client
    devices = c.devices[:4]
    exe = c.compile("add4", devices)  # x tiled, y replicated over devices 0-3
    if wrong == "x replicated":
        args = [c.put(X, c.replicated(devices)), c.put(Y, c.replicated(devices))]
    else:
        args = [c.put(X, c.tiled(devices)), c.put(Y, c.tiled(devices))]
    out, status = c.execute(exe, args)
    assert _refused(status, INVALID), status
    assert "sharding" in status[1], status
    c.assert_up()
    # The right call still computes.
    out, status = c.execute(exe, [c.put(X, c.tiled(devices)), c.put(Y, c.replicated(devices))])
    assert status[0] == OK, status
    assert c.value(out) == (X + Y).tobytes()


# ---- 2. device_ordinal out of range ------------------------------------------------------

@pytest.mark.parametrize("assignment", [True, False])
def test_compile_with_device_ordinal_out_of_range(client: Client, assignment: bool) -> None:
    c = client
    options = c.options(c.devices[:1], device_ordinal=len(c.devices))
    if not assignment:
        options.compile_options.executable_build_options.ClearField("device_assignment")
    body = c.raw.msg("CompileRequest")
    body.program.type_name = "xla::ifrt::XlaProgram"
    body.program.data = lowered()["add1"]
    body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
    body.compile_options.data = options.SerializeToString()
    reply = c.raw.call("compile_request", body)
    status = status_of(reply)
    assert status[0] in (OK, INVALID) and "bug in isthmus" not in status[1], status
    c.assert_up()
    if status[0] == OK:  # ignored: the program runs where its assignment says
        exe = reply.compile_response.loaded_executable_handle
        device = [c.devices[0]]
        out, status = c.execute(exe, [c.put(X, c.replicated(device))])
        assert status[0] == OK, status
        assert c.value(out) == (X + 1).tobytes()


# ---- 3. a permuted device list ---------------------------------------------------------

@pytest.mark.parametrize("order", [[3, 2, 1, 0], [1, 2, 3, 0]])
def test_execute_with_permuted_devices(any_client: Client, order: list[int]) -> None:
    c = any_client
    devices = c.devices[:4]
    exe = c.compile("add4", devices)
    x = c.put(X, c.tiled([devices[i] for i in order]))
    out, status = c.execute(exe, [x, c.put(Y, c.replicated(devices))])
    if status[0] == OK:
        status, got = c.read(out)
        if status[0] == OK:
            assert got.tobytes() == (X + Y).tobytes(), f"wrong result {got}"
    assert status[0] == OK or _refused(status, INVALID), status
    c.assert_up()


# ---- 4. one host buffer named twice ------------------------------------------------------

@pytest.mark.parametrize("earlier", [False, True])
def test_two_arrays_on_one_host_buffer(client: Client, earlier: bool) -> None:
    """`earlier`: a request before them still waits for its own upload (the fuzzer found
    the second one then accepted, failing DEADLINE_EXCEEDED after --host-buffer-timeout)."""
    c = client
    host = c.handle()
    first, second = c.handle(), c.handle()
    sharding = c.replicated(c.devices[:1])
    if earlier:
        waiting_host, waiting = c.handle(), c.handle()
        c.raw.send("make_array_from_host_buffer_request",
                   c.make_body(Y, sharding, waiting_host, waiting))
    op1 = c.raw.send("make_array_from_host_buffer_request",
                     c.make_body(X, sharding, host, first))
    op2 = c.raw.send("make_array_from_host_buffer_request",
                     c.make_body(X, c.replicated(c.devices[1:2]), host, second))
    c.raw.store(host, X.tobytes())
    if earlier:
        c.raw.store(waiting_host, Y.tobytes())
    s1, s2 = status_of(c.raw.wait(op1, 10)), status_of(c.raw.wait(op2, 10))
    assert s1[0] == OK, s1
    status, got = c.read(first)
    assert status[0] == OK and got.tobytes() == X.tobytes(), status
    if s2[0] == OK:  # refused when its array is used, then
        s2 = c.ready(second)
    assert _refused(s2, INVALID), s2
    c.assert_up()


def test_one_host_buffer_for_two_shards(client: Client) -> None:
    c = client
    devices = c.devices[:2]
    host, handle = c.handle(), c.handle()
    body = c.raw.msg("MakeArraysFromHostBufferShardsRequest", array_handles=[handle])
    spec = body.specs.add()
    spec.array_spec.dtype.kind = c.s["xla.ifrt.DTypeProto"].KIND_F32
    spec.array_spec.shape.dims.extend([8])
    spec.array_spec.sharding.CopyFrom(c.tiled(devices))
    for i in range(2):
        spec.addressable_shard_indices.add(indices=[i])
        buffer = spec.host_buffers.add(host_buffer_handle=host)
        buffer.dtype.kind = c.s["xla.ifrt.DTypeProto"].KIND_F32
        buffer.shape.dims.extend([4])
    op = c.raw.send("make_arrays_from_host_buffer_shards_request", body)
    c.raw.store(host, X[:4].tobytes())
    status = status_of(c.raw.wait(op, 10))
    if status[0] == OK:
        status = c.ready(handle)
    assert _refused(status, INVALID), status
    c.assert_up()


# ---- 5. order while an upload is late --------------------------------------------------

@pytest.mark.parametrize("use", ["copy", "execute", "ready", "disassemble_donate"])
def test_requests_act_in_the_order_sent(client: Client, use: str) -> None:
    c = client
    device = c.devices[:1]
    exe = c.compile("add1", device)
    x = c.put(X, c.replicated(device))
    assert c.ready(x)[0] == OK
    late_host, late = c.handle(), c.handle()
    c.raw.send("make_array_from_host_buffer_request",
               c.make_body(Y, c.replicated(device), late_host, late))  # its data comes later
    result, host = c.handle(), c.handle()
    if use == "copy":
        op = c.raw.send("copy_to_host_buffer_request", c.raw.msg(
            "CopyToHostBufferRequest", array_handle=x, host_buffer_handle=host))
    elif use == "execute":
        op = c.raw.send("loaded_executable_execute_request", c.execute_body(exe, [x], result))
    elif use == "ready":
        op = c.raw.send("check_value_ready_request",
                        c.raw.msg("CheckValueReadyRequest", value_handles=[x]))
    else:
        op = c.raw.send("disassemble_into_single_device_arrays_request", c.raw.msg(
            "DisassembleIntoSingleDeviceArraysRequest", array_handle=x, copy_semantics=3,
            result_handles=[result]))
    delete = c.raw.send("delete_array_request", c.raw.msg("DeleteArrayRequest",
                                                          array_handle=[x]))
    c.raw.store(late_host, Y.tobytes())
    status = status_of(c.raw.wait(op, 10))
    assert status[0] == OK, status
    if use == "copy":
        assert c.raw.lookup(host) == X.tobytes()
    elif use == "execute":
        assert c.value(result) == (X + 1).tobytes()
    elif use == "disassemble_donate":
        # x was donated to its disassembly before the delete: the part keeps the data and
        # the delete finds x gone already (either answer is clean).
        assert c.value(result) == X.tobytes()
    if use != "disassemble_donate":
        assert status_of(c.raw.wait(delete, 10))[0] == OK
    assert c.value(late) == Y.tobytes()
    c.assert_up()


# ---- 6. readiness checked, then donated ------------------------------------------------

@pytest.mark.parametrize("check", ["CheckValueReady", "CheckFuture of the status"])
def test_check_then_donate(client: Client, check: str) -> None:
    c = client
    device = c.devices[:1]
    exe = c.compile("add1_donate", device)
    x = c.put(X, c.replicated(device))
    out, status_handle = c.handle(), c.handle()
    first = c.execute_body(exe, [x], out)
    first.result_status_handle = status_handle
    first.execute_options.fill_status = True
    ops = [c.raw.send("loaded_executable_execute_request", first)]
    if check == "CheckValueReady":
        ops.append(c.raw.send("check_value_ready_request",
                              c.raw.msg("CheckValueReadyRequest", value_handles=[out])))
    else:
        ops.append(c.raw.send("check_future_request",
                              c.raw.msg("CheckFutureRequest", future_handle=status_handle)))
    again = c.handle()
    ops.append(c.raw.send("loaded_executable_execute_request",
                          c.execute_body(exe, [out], again)))
    for op in ops:
        status = status_of(c.raw.wait(op, 10))
        assert status[0] == OK, status
    assert c.value(again) == (X + 2).tobytes()
    c.assert_up()


# ---- 7. remap intervals past int64 -----------------------------------------------------

def test_remap_with_a_huge_interval(client: Client) -> None:
    c = client
    from tests.integration.rawclient import array_spec

    a, b = c.devices[:2], c.devices[2:4]
    xa, xb = c.put(X, c.tiled(a)), c.put(Y, c.tiled(b))
    plan = c.s["xla.ifrt.RemapPlanProto"]()
    plan.input_specs.append(array_spec(c.s, "KIND_F32", [8], c.tiled(a)))
    plan.input_specs.append(array_spec(c.s, "KIND_F32", [8], c.tiled(b)))
    plan.output_specs.append(array_spec(c.s, "KIND_F32", [16], c.tiled(a + b)))
    plan.mappings.add(in_array=0, out_array=0, from_start=[-(1 << 63)],
                      from_end=[(1 << 63) - 1], from_step=[1], to_start=[0], to_end=[2],
                      to_step=[1])
    plan.mappings.add(in_array=1, out_array=0, from_start=[0], from_end=[2], from_step=[1],
                      to_start=[2], to_end=[4], to_step=[1])
    body = c.raw.msg("RemapArraysRequest", array_handles=[xa, xb], result_handles=[c.handle()],
                     copy_semantics=2)
    body.plan.CopyFrom(plan)
    status = status_of(c.raw.call("remap_arrays_request", body))
    assert _refused(status, INVALID), status
    assert c.value(xa) == X.tobytes()
    c.assert_up()


# ---- 8 and 9. hostile shapes and strides -----------------------------------------------

def _hostile_put(c: Client, shape: list[int], strides: list[int] | None, data: bytes
                 ) -> tuple[int, str]:
    host, handle = c.handle(), c.handle()
    body = c.raw.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=host,
                     array_handle=handle)
    body.dtype.kind = c.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend(shape)
    body.sharding.CopyFrom(c.replicated(c.devices[:1]))
    if strides is not None:
        body.byte_strides.strides.extend(strides)
    op = c.raw.send("make_array_from_host_buffer_request", body)
    c.raw.store(host, data)
    status = status_of(c.raw.wait(op, 10))
    return status if status[0] != OK else c.ready(handle)


def test_zero_size_array_with_a_huge_dimension(client: Client) -> None:
    status = _hostile_put(client, [3, 0, 1 << 62], None, b"")
    assert _refused(status, INVALID, EXHAUSTED), status
    client.assert_up()


@pytest.mark.parametrize("shape,strides,size", [
    ([1 << 22], [0], 4),  # 16 MiB from 4 bytes
    ([1 << 37], [0], 16),  # 512 GiB from 16 bytes
    ([1 << 37], None, 16),
])
def test_amplifying_strides_are_refused_before_allocating(
        client: Client, shape: list[int], strides: list[int] | None, size: int) -> None:
    start = time.monotonic()
    status = _hostile_put(client, shape, strides, bytes(size))
    assert _refused(status, INVALID, EXHAUSTED), status
    assert time.monotonic() - start < 5
    client.assert_up()


# ---- 10. an argument in host memory ----------------------------------------------------

@pytest.mark.parametrize("memory", ["pinned_host", "unpinned_host"])
def test_execute_with_an_argument_in_host_memory(client: Client, memory: str) -> None:
    c = client
    device = c.devices[:1]
    exe = c.compile("add1", device)
    x = c.put(X, c.replicated(device, memory))
    out, status = c.execute(exe, [x])
    assert _refused(status, INVALID), status
    assert "memory" in status[1], status
    c.assert_up()


# ---- 11. empty requests ----------------------------------------------------------------

@pytest.mark.parametrize("kind", [
    "copy_arrays_request", "reshard_arrays_request", "bitcast_arrays_request",
    "make_error_arrays_request", "make_arrays_from_host_buffer_shards_request"])
def test_empty_request_answers_with_its_message(client: Client, kind: str) -> None:
    reply = client.raw.call(kind, None)
    status = status_of(reply)
    assert status[0] != INTERNAL and "bug in isthmus" not in status[1], status
    if status[0] == OK:
        assert has_body(reply), f"{kind}: OK with the oneof unset"
        assert reply.WhichOneof("response") == kind.replace("_request", "_response")
    client.assert_up()


# ---- found by the fuzzer after the eleven ----------------------------------------------

@pytest.mark.parametrize("program", ["addxy4_donate", "addxy_donate"])
def test_one_array_as_a_donated_and_a_plain_argument(any_client: Client, program: str
                                                     ) -> None:
    """f(x, x) where f donates its first argument, on 4 devices (and 2 for the 1-device
    program compiled over two): a clean error, as jaxlib gives on one device."""
    c = any_client
    devices = c.devices[:4] if program == "addxy4_donate" else c.devices[:2]
    exe = c.compile(program, devices)
    sharding = c.tiled(devices) if program == "addxy4_donate" else c.replicated(devices)
    x = c.put(X, sharding)
    out, status = c.execute(exe, [x, x])
    if status[0] == OK:
        status = c.read(out)[0]
    assert _refused(status, INVALID), status
    c.assert_up()


def test_a_donation_holds_even_when_the_program_does_not_run(client: Client) -> None:
    """x donated to a call whose other argument carries an error: the call fails with that
    error, and x is gone all the same (the client counts it donated at dispatch); a read of
    it must not hand back its old bytes. Found by the fuzzer (seed 78 on a 2x1x2 fleet)."""
    c = client
    device = c.devices[:1]
    exe = c.compile("addxy_donate", device)
    x = c.put(X, c.replicated(device))
    bad, host = c.handle(), c.handle()
    c.raw.store(host, b"\0" * 12)  # 3 floats for an f32[8]: the array carries the error
    assert status_of(c.raw.call("make_array_from_host_buffer_request",
                                c.make_body(Y, c.replicated(device), host, bad)))[0] == OK
    out, status = c.execute(exe, [x, bad])
    assert status[0] == OK, status
    assert _refused(c.ready(out), INVALID), c.ready(out)
    status, got = c.read(x)
    assert _refused(status, FAILED_PRECONDITION) and "deleted" in status[1], (status, got)
    c.assert_up()


def test_a_copy_without_a_memory_kind_keeps_the_arrays_own(client: Client) -> None:
    """CopyArrays that names no memory kind keeps each array's (IFRT's
    WithDeviceAssignment): a pinned_host array copied to another device is pinned_host
    there, so a bitcast that says so is accepted and reads the same bytes. Found by the
    fuzzer (the copy landed in device memory while the client counted it pinned)."""
    c = client
    x = c.put(X, c.replicated(c.devices[:1], "pinned_host"))
    copy = c.handle()
    reply = c.raw.call("copy_arrays_request", c.raw.msg(
        "CopyArraysRequest", array_handles=[x], device_ids=[c.devices[1]],
        result_handles=[copy]))
    assert status_of(reply)[0] == OK, status_of(reply)
    cast = c.handle()
    body = c.raw.msg("BitcastArraysRequest", array_handles=[copy], result_handles=[cast])
    spec = body.array_specs.add()
    spec.dtype.kind = c.s["xla.ifrt.DTypeProto"].KIND_F32
    spec.shape.dims.extend(X.shape)
    spec.sharding.CopyFrom(c.replicated(c.devices[1:2], "pinned_host"))
    reply = c.raw.call("bitcast_arrays_request", body)
    assert status_of(reply)[0] == OK, status_of(reply)
    assert c.value(cast) == X.tobytes()
    c.assert_up()
