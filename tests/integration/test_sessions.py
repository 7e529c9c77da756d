"""Memory accounting, cleanup at session end, and concurrent sessions."""

import threading

import numpy as np
import pytest

from isthmus.testing import LocalServer, wait_until
from tests.integration.harness import compare, run_snippet
from tests.integration.rawclient import RawSession, hlo_sharding, status_of


def _worker_bytes(server):
    workers = server.status()["workers"]
    return sum(w["worker_bytes"] for w in workers.values()), \
        sum(w["bytes"] for w in workers.values())


@pytest.fixture(scope="module")
def two_devices():
    """One server for the accounting tests: each ends with it holding nothing again."""
    with LocalServer(devices=2) as server:
        yield server
        assert server.alive(), server.log()


def test_deletion_frees_server_memory(two_devices):
    out = run_snippet("""
        import gc, sys, time, jax
        from isthmus.wire.servicer import fetch_status
        address = __import__("os").environ["JAX_BACKEND_TARGET"]
        def held():
            return sum(w["worker_bytes"] for w in fetch_status(address)["workers"].values())
        def settled(expected):  # the workers apply frees in order, soon: wait for it
            deadline = time.monotonic() + 10
            while held() != expected and time.monotonic() < deadline:
                time.sleep(0.01)
            return held()
        x = jax.device_put(np.ones((1024, 1024), np.float32))   # 4 MiB
        y = jax.jit(lambda a: a * 2)(x)
        y.block_until_ready()
        emit("with_arrays", held())
        x.delete()
        emit("after_delete", settled(4 << 20))
        del y; gc.collect()
        emit("after_drop", settled(0))
        emit("y_value_was", 2.0)
    """, two_devices.address)
    assert out["with_arrays"] == 8 << 20
    assert out["after_delete"] == 4 << 20
    assert out["after_drop"] == 0
    wait_until(lambda: _worker_bytes(two_devices) == (0, 0), 10, "the workers to hold nothing",
               explain=lambda: f"status: {two_devices.status()}")


def test_disconnect_frees_everything_the_session_held(two_devices):
    raw = RawSession(two_devices.address)
    data = np.ones(1 << 18, np.float32)
    raw.store(5, data.tobytes())
    body = raw.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=5, array_handle=5)
    body.dtype.kind = raw.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.append(data.size)
    body.sharding.CopyFrom(hlo_sharding(raw.s, [0]))
    raw.call("make_array_from_host_buffer_request", body)
    ready = raw.call("check_value_ready_request",
                     raw.msg("CheckValueReadyRequest", value_handles=[5]))
    assert not status_of(ready)[0]
    assert _worker_bytes(two_devices) == (1 << 20, 1 << 20)
    raw.store(6, b"x" * 1000)  # a host buffer nobody used
    assert two_devices.status()["sessions"][str(raw.session_id)]["host_buffer_bytes"] == 1000
    raw.close()  # the client goes away without deleting anything
    wait_until(lambda: _worker_bytes(two_devices) == (0, 0), 10,
               "the workers to free the session's arrays",
               explain=lambda: f"status: {two_devices.status()}")
    wait_until(lambda: not two_devices.status()["sessions"], 10, "the session to end",
               explain=lambda: f"status: {two_devices.status()}")


def test_two_concurrent_sessions(server):
    code = """
        import jax, jax.numpy as jnp
        seed = int(__import__("os").environ.get("SEED", "0"))
        x = np.random.default_rng(seed).standard_normal((128, 128)).astype(np.float32)
        f = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
        y = x
        for _ in range(20):
            y = f(y)
        emit("y", y)
    """
    results = {}
    errors = []

    def run(name):
        try:
            results[name] = compare(code, server.address)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == 2
