"""A transfer beyond 1 GiB each way (slow: run with `scripts/test -m slow`)."""

import pytest

from isthmus.testing import LocalServer
from tests.integration.harness import run_snippet


@pytest.mark.slow
def test_one_gibibyte_round_trip():
    with LocalServer(devices=2) as server:
        out = run_snippet("""
            import jax, time
            n = (1 << 30) // 4 + 1024            # a little over 1 GiB of float32
            x = np.arange(n, dtype=np.float32)
            t = time.perf_counter()
            y = jax.device_put(x, jax.devices()[1])
            z = jax.jit(lambda a: a[::1 << 20] + 1)(y)
            back = np.asarray(y)
            emit("equal", bool(np.array_equal(back, x)))
            emit("probe", z)
            emit("seconds", time.perf_counter() - t)
        """, server.address, timeout=900)
        assert bool(out["equal"])
        assert out["probe"][:3].tolist() == [1.0, 1048577.0, 2097153.0]
        assert server.status()["workers"]["0"]["worker_bytes"] == 0
