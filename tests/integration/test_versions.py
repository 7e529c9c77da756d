"""A client and a server on different jax versions (the test script makes both environments
and names the other one's Python in ISTHMUS_OTHER_PYTHON): the pairs docs say work, work, and
every result equals local jax on the client's own version."""

import functools
import os
import subprocess

import pytest

from isthmus.testing import LocalServer
from tests.integration.harness import compare

OTHER = os.environ.get("ISTHMUS_OTHER_PYTHON")
pytestmark = pytest.mark.skipif(
    not OTHER, reason="needs ISTHMUS_OTHER_PYTHON (scripts/test sets it when both "
                      "environments exist)")

DAY_ONE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
emit("jit", jax.jit(lambda a: jnp.sin(a) @ a.T)(jnp.arange(12.0).reshape(3, 4)))
mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("x")))
emit("sharded_sum", jax.jit(lambda a: (a * 2).sum(axis=0))(x))
emit("reshard", jax.device_put(x, NamedSharding(mesh, P(None, "x"))))
emit("random", jax.random.normal(jax.random.key(0), (5,)))
def loss(w, a):
    return jnp.mean(jnp.tanh(a @ w) ** 2)
w = jnp.ones((4, 3)) * 0.1
for _ in range(3):
    value, grad = jax.jit(jax.value_and_grad(loss))(w, x)
    w = w - 0.1 * grad
emit("loss", value)
emit("w", w)
"""


@functools.cache  # one jax import per interpreter, not one per test
def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import jax; print(jax.__version__)"],
                          capture_output=True, text=True, check=True, timeout=120).stdout.strip()


@pytest.mark.parametrize("backend", ["embedded", "fleet"])
def test_a_client_of_this_jax_on_a_server_of_the_other(backend):
    shape = {"devices": 8} if backend == "embedded" else {"devices": None,
                                                         "fleet": (1, 2, 4)}
    with LocalServer(python=OTHER, **shape) as server:
        status = server.status()
        assert status["server_jax"] == _version(OTHER)
        compare(DAY_ONE, server.address, rtol=1e-6, atol=1e-6)
        assert server.alive(), server.log()
