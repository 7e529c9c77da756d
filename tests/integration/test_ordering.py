"""Issue 37: requests that wait for the wrong thing. An execution's status waits for its own
place in the dispatch order, not for requests sent after it; every source of a move stays
pinned from its dispatch until its last command is sent, so a delete of the input sent right
after a reshard cannot free it under the worker. Raw protocol, on both backends (the moves
between workers happen on the fleet, a 2 x 1 x 2 one).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.integration.rawclient import array_spec, status_of, tiled_sharding
from tests.integration.rawservers import ARGS, OK, Client, Servers

X = np.arange(8, dtype=np.float32)
REUSE_INPUT, SHARD_ALL = 2, 1


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


@pytest.fixture(params=["embedded", "fleet"])
def any_client(request: pytest.FixtureRequest, servers: Servers) -> Iterator[Client]:
    c = Client(servers.get(request.param))
    yield c
    c.close()


def test_a_status_waits_for_its_own_execution_only(any_client: Client) -> None:
    """A later array made from a host buffer that never comes (it fails after the server's
    2 s host-buffer deadline) must not hold the status of an execution that ran before it."""
    assert "--host-buffer-timeout" in ARGS and "2" in ARGS
    c = any_client
    device = c.devices[:1]
    exe = c.compile("add1", device)
    x = c.put(X, c.replicated(device))
    out, status_handle = c.handle(), c.handle()
    body = c.execute_body(exe, [x], out)
    body.result_status_handle = status_handle
    body.execute_options.fill_status = True
    assert status_of(c.raw.call("loaded_executable_execute_request", body))[0] == OK
    assert c.ready(out)[0] == OK  # the execution is over
    started = time.monotonic()
    never_host, never = c.handle(), c.handle()
    c.raw.send("make_array_from_host_buffer_request",
               c.make_body(X, c.replicated(device), never_host, never))
    ready_never = c.raw.send("check_value_ready_request",
                             c.raw.msg("CheckValueReadyRequest", value_handles=[never]))
    fetch = c.raw.send("loaded_executable_fetch_execute_result_request", c.raw.msg(
        "LoadedExecutableFetchExecuteResultRequest", result_status_handle=status_handle))
    # A later request on the same never-defined buffer, after the fetch.
    c.raw.send("check_value_ready_request",
               c.raw.msg("CheckValueReadyRequest", value_handles=[never]))
    status = status_of(c.raw.wait(fetch, 10))
    elapsed = time.monotonic() - started
    assert status[0] == OK, status
    # Waiting for the later request would take the host-buffer deadline (2 s) at least.
    assert elapsed < 2.0, f"the status waited {elapsed:.1f} s, for a request sent after it"
    # The never-uploaded array still fails on its own, cleanly.
    assert status_of(c.raw.wait(ready_never, 10))[0] != OK
    assert c.value(out) == (X + 1).tobytes()
    c.assert_up()


def _reshard(c: Client, array: int, shape: list[int], sharding: object) -> tuple[int, int]:
    out = c.handle()
    op = c.raw.send("reshard_arrays_request", c.raw.msg(
        "ReshardArraysRequest", array_handles=[array], copy_semantics=1, result_handles=[out],
        array_specs=[array_spec(c.s, "KIND_F32", shape, sharding)]))
    return out, op


@pytest.mark.parametrize("free", ["destruct_array_request", "delete_array_request"])
def test_a_reshard_whose_input_is_freed_at_once(any_client: Client, free: str) -> None:
    """`y = reshard(x); del x`: on the fleet each target shard needs pieces from the other
    worker, pulled first; the Assemble sent after the pulls also reads the local shards of
    x, which the free sent right after the reshard must not take away."""
    c = any_client
    devices = c.devices[:4]
    for attempt in range(3):
        value = np.arange(32, dtype=np.float32).reshape(8, 4) + attempt
        x = c.put(value, _tiled_rows(c, devices))
        assert c.ready(x)[0] == OK
        y, op = _reshard(c, x, [8, 4], c.replicated(devices))
        gone = c.raw.send(free, c.raw.msg(
            "DestructArrayRequest" if free.startswith("destruct") else "DeleteArrayRequest",
            array_handle=[x]))
        assert status_of(c.raw.wait(op))[0] == OK
        assert status_of(c.raw.wait(gone))[0] == OK
        assert c.ready(y) == (OK, ""), c.ready(y)
        assert c.value(y) == value.tobytes()
    c.assert_up()


def _tiled_rows(c: Client, devices: list[int]) -> object:
    return tiled_sharding(c.s, devices, [len(devices), 1])


def test_a_replicated_pull_whose_first_target_is_deleted(any_client: Client) -> None:
    """An array on device 0 resharded to both devices of the other worker: the first target
    is pulled, the second copied from it when the pull ends. Deleting the first target (a
    part of the result's disassembly) right away must not take the copy's source."""
    c = any_client
    for attempt in range(3):
        value = X + 10 * attempt
        x = c.put(value, c.replicated(c.devices[:1]))
        y, op = _reshard(c, x, [8], c.replicated(c.devices[-2:]))
        parts = [c.handle(), c.handle()]
        split = c.raw.send("disassemble_into_single_device_arrays_request", c.raw.msg(
            "DisassembleIntoSingleDeviceArraysRequest", array_handle=y,
            copy_semantics=REUSE_INPUT, single_device_shard_semantics=SHARD_ALL,
            result_handles=parts))
        gone = c.raw.send("delete_array_request", c.raw.msg(
            "DeleteArrayRequest", array_handle=[parts[0]]))
        for request in (op, split, gone):
            assert status_of(c.raw.wait(request))[0] == OK
        assert c.ready(parts[1]) == (OK, ""), c.ready(parts[1])
        assert c.value(parts[1]) == value.tobytes()
    c.assert_up()
