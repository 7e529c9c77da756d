"""`--simulate-flops` through the stock client: on an embedded backend and on a fleet whose
launched workers get the option, a program's first call is computed (and matches numpy),
and a chain of later calls takes at least its simulated device time (a real run of this
program takes microseconds, so only the simulation can make it that slow)."""

import pytest

from isthmus.testing import LocalServer, run_python

N = 64
SECONDS = 0.1  # per simulated call of one matmul over the program's devices

CLIENT = f"""
import time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
mesh = Mesh(np.array(devices), ("d",))
x = np.eye({N}, dtype=np.float32) * 0.5 + 0.01
w = jax.device_put(x, NamedSharding(mesh, P()))
step = jax.jit(lambda v: jnp.tanh(v @ w))
first = step(jax.device_put(x, NamedSharding(mesh, P("d"))))
np.testing.assert_allclose(np.asarray(first), np.tanh(x @ x), rtol=1e-5)
began = time.monotonic()
y = first
for _ in range(10):
    y = step(y)
value = np.asarray(y)
elapsed = time.monotonic() - began
assert value.shape == ({N}, {N}) and value.dtype == np.float32, (value.shape, value.dtype)
print(f"{{len(devices)}} devices; 10 simulated calls in {{elapsed:.3f}} s")
assert elapsed >= 10 * {SECONDS} * 0.999, elapsed
"""


@pytest.mark.parametrize("shape", [{"devices": 2}, {"devices": None, "fleet": (1, 2, 1)}],
                         ids=["embedded", "fleet"])
def test_programs_take_their_simulated_time(shape):
    devices = 2
    rate = 2 * N ** 3 / devices / SECONDS  # FLOP/s per device: each holds half the rows
    with LocalServer(**shape, args=[f"--simulate-flops={rate:g}"]) as server:
        result = run_python(CLIENT, server.address, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert f"{devices} devices; 10 simulated calls" in result.stdout, result.stdout
        assert server.alive(), server.log()


def test_simulate_flops_is_refused_with_cuda():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "isthmus.cli", "up", "--platform", "cuda",
                             "--simulate-flops", "1e12"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    assert "--simulate-flops simulates accelerators on the CPU" in result.stderr, result.stderr
