"""Issue 37: the trust boundary. A client's program bytes are parsed first in a disposable
process (`controller/vetting.py`); damaged bytes get a clean error, and bytes that take that
process down are refused, while the server, its workers and every session keep running.
Raw protocol (a stock client never sends damaged programs), on both backends.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest

from isthmus.testing import LocalServer, process_alive
from tests.integration.fuzz_programs import lowered
from tests.integration.rawclient import status_of
from tests.integration.rawservers import OK, Client

INVALID = 3
MARKER = "isthmus-vetting-crash-marker"


@pytest.fixture(scope="module", params=["embedded", "fleet"])
def server(request: pytest.FixtureRequest) -> Iterator[LocalServer]:
    env = dict(os.environ, ISTHMUS_TEST_CRASH_VETTING=MARKER)
    if request.param == "embedded":
        server = LocalServer(devices=4, env=env)
    else:
        server = LocalServer(devices=None, fleet=(2, 1, 2), env=env)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(server: LocalServer) -> Iterator[Client]:
    c = Client(server)
    yield c
    c.close()


def _compile_bytes(c: Client, data: bytes, devices: list[int]) -> tuple[int, str]:
    body = c.raw.msg("CompileRequest")
    body.program.type_name = "xla::ifrt::XlaProgram"
    body.program.data = data
    body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
    body.compile_options.data = c.options(devices).SerializeToString()
    return status_of(c.raw.call("compile_request", body, timeout=60))


def _still_computes(c: Client) -> None:
    c.assert_up()
    device = c.devices[:1]
    x = np.arange(8, dtype=np.float32)
    out, status = c.execute(c.compile("add1", device), [c.put(x, c.replicated(device))])
    assert status[0] == OK, status
    assert c.value(out) == (x + 1).tobytes()


def test_damaged_programs_get_a_clean_error(client: Client) -> None:
    """Valid programs with a few bytes changed past their header, as a buggy or hostile
    client sends them: each is refused with INVALID_ARGUMENT naming the cause, or (where
    the change left a valid program) compiles; nothing dies."""
    c = client
    base = lowered()["add4"]
    rng = random.Random(37)
    outcomes = {OK: 0, INVALID: 0}
    for _ in range(40):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(32, len(data))] = rng.randrange(256)
        code, message = _compile_bytes(c, bytes(data), c.devices[:4])
        assert code in outcomes and "bug in isthmus" not in message, (code, message)
        outcomes[code] += 1
    assert outcomes[INVALID] > 0, outcomes
    _still_computes(c)


def test_bytes_that_crash_the_parser_are_refused_and_nothing_else_is_lost(
        client: Client) -> None:
    c = client
    device = c.devices[:1]
    x = np.arange(8, dtype=np.float32)
    kept = c.put(x, c.replicated(device))  # an array that must survive
    doomed = lowered()["add1"] + MARKER.encode()
    code, message = _compile_bytes(c, doomed, device)
    assert code == INVALID and "crashed the process that parses programs" in message, (
        code, message)
    for pid in c.pids:
        assert process_alive(pid)
    # The same bytes are refused from now on, without another process dying for them.
    code, message = _compile_bytes(c, doomed, device)
    assert code == INVALID and "refuses these bytes" in message, (code, message)
    assert c.value(kept) == x.tobytes()
    _still_computes(c)  # the next program gets a fresh parsing process


def test_an_upload_refused_for_its_size_fails_its_array_at_once(client: Client) -> None:
    """A negative announced size is refused, and the array made from that host buffer
    fails with the reason now, not after the host-buffer timeout (10 s here)."""
    import time

    import grpc

    c = client
    device = c.devices[:1]
    x = np.arange(8, dtype=np.float32)
    host, array = c.handle(), c.handle()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        c.raw.store(host, x.tobytes(), announce=-1)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    c.raw.call("make_array_from_host_buffer_request",
               c.make_body(x, c.replicated(device), host, array))
    code, message = c.ready(array)
    assert code == INVALID and "cannot have -1 bytes" in message, (code, message)
    assert time.monotonic() - started < 5, "the array waited for the host-buffer timeout"
    _still_computes(c)


def test_a_program_xla_refuses_for_its_options_is_invalid_argument(client: Client) -> None:
    """A module lowered for Shardy compiled with `use_shardy_partitioner=False`: XLA's
    partitioner refuses it with a RET_CHECK (INTERNAL to XLA); to the client it is its
    program's error, INVALID_ARGUMENT with XLA's message."""
    c = client
    devices = c.devices[:4]
    options = c.options(devices, use_shardy_partitioner=False)
    body = c.raw.msg("CompileRequest")
    body.program.type_name = "xla::ifrt::XlaProgram"
    body.program.data = lowered()["add4"]
    body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
    body.compile_options.data = options.SerializeToString()
    code, message = status_of(c.raw.call("compile_request", body, timeout=60))
    assert code == INVALID and "RET_CHECK" in message, (code, message)  # XLA's own words
    _still_computes(c)
