"""Both transports of the client port (`--client-transport h2` and `grpc`) serve the stock
client alike: sharded puts, programs, fetches of arrays larger than every flow-control
window, an array over the server's limit (refused, the session goes on), a pipelined loop,
and two clients at once; the results match numpy."""

import pytest

from isthmus.testing import LocalServer, run_python

CLIENT = """
import jax, numpy as np, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
rows = NamedSharding(mesh, P("x"))
x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
a = jax.device_put(x, rows)
np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v * 2 + 1)(a)), x * 2 + 1)
big = np.random.default_rng(0).standard_normal((3 << 20) // 2).astype(np.float32)  # 6 MiB
b = jax.device_put(big)
np.testing.assert_array_equal(np.asarray(b), big)
np.testing.assert_allclose(float(jnp.sum(b)), big.astype(np.float64).sum(), rtol=1e-4)
y = jax.device_put(np.float32(0))
f = jax.jit(lambda v: v + 1)
for _ in range(500):
    y = f(y)
assert float(y) == 500.0, float(y)
try:  # over the server's --max-array-bytes: refused, and the session goes on
    np.asarray(jax.device_put(np.zeros(5 << 20, np.float32)) + 1)
except Exception as e:
    print("REFUSED", "RESOURCE_EXHAUSTED" in str(e), "limit" in str(e))
np.testing.assert_array_equal(np.asarray(f(a)), x + 1)
print("OK")
"""


@pytest.mark.parametrize("transport", ["h2", "grpc"])
def test_the_stock_client_through_each_transport(transport):
    with LocalServer(devices=2, args=["--client-transport", transport,
                                      "--max-array-bytes", str(16 << 20)]) as server:
        results = [run_python(CLIENT, server.address, timeout=180) for _ in range(2)]
        assert server.alive(), server.log()
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert "REFUSED True True" in result.stdout and "OK" in result.stdout, result.stdout
