"""The plain loops real code runs, never waiting between steps, on every fleet shape: a step
that donates its input with a cross-device sum in it (issue 36: it hung the default fleet),
one without a collective, a data-parallel training step donating its parameters, and steps
interleaved with independent collective programs and reads. Every result is compared with
local jax (or numpy, where local jax itself would hang). (Meshes are built with `Mesh`:
`jax.make_mesh` refuses devices of several slices.)"""

import numpy as np
import pytest

from isthmus.testing import LocalServer
from tests.integration.harness import compare, run_snippet

# The shapes of fleet the loops run on besides the suite's two backends (`server`): the
# default fleet (1 slice x 2 hosts x 4 devices) and two slices of one host each.
SHAPES = {"default": {"devices": None}, "two-slices": {"devices": None, "fleet": (2, 1, 4)}}

DONATING_SUM = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = len(jax.devices())
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
f = jax.jit(lambda x: x + jnp.sum(jnp.tanh(x) ** 2), donate_argnums=0)
x = jax.device_put(np.linspace(-1, 1, 4096 * n, dtype=np.float32), s)
for i in range(STEPS):
    x = f(x)                                  # no wait between steps
emit("x", x)
"""

LOOPS = {
    # The seven lines of issue 36, longer.
    "donating-sum": DONATING_SUM.replace("STEPS", "20"),
    # The same without a collective: each device's step reads only its shard.
    "donating-elementwise": """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = len(jax.devices())
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
f = jax.jit(lambda x: jnp.tanh(x) * 1.5 + 0.25, donate_argnums=0)
x = jax.device_put(np.linspace(-1, 1, 1024 * n, dtype=np.float32), s)
for i in range(30):
    x = f(x)
emit("x", x)
""",
    # Data-parallel SGD on a replicated MLP, parameters and optimizer state donated, the batch
    # sharded: the gradients' all-reduce is the step's collective.
    "donating-train-step": """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = len(jax.devices())
mesh = Mesh(np.array(jax.devices()), ("data",))
rows, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
rng = np.random.default_rng(0)
params = {"w1": rng.normal(size=(16, 32)).astype(np.float32) * 0.3,
          "w2": rng.normal(size=(32, 1)).astype(np.float32) * 0.3}
params = jax.device_put(params, repl)
moment = jax.tree.map(jnp.zeros_like, params)
def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
@jax.jit
def step(p, m, x, y):
    l, g = jax.value_and_grad(loss)(p, x, y)
    m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
    return jax.tree.map(lambda p, m: p - 0.05 * m, p, m), m, l
step = jax.jit(step, donate_argnums=(0, 1))
losses = []
for i in range(25):
    x = jax.device_put(rng.normal(size=(8 * n, 16)).astype(np.float32), rows)
    y = jax.device_put(rng.normal(size=(8 * n, 1)).astype(np.float32), rows)
    params, moment, l = step(params, moment, x, y)
    losses.append(l)
emit("losses", jnp.stack(losses))
emit("w1", params["w1"])
emit("w2", params["w2"])
""",
    # Donating steps interleaved with independent collective programs (sums of another
    # array, never waited for) and a read every few steps.
    "donating-interleaved": """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = len(jax.devices())
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
f = jax.jit(lambda x: x * 0.5 + jnp.mean(x), donate_argnums=0)
total = jax.jit(lambda x: jnp.sum(x * x))
x = jax.device_put(np.arange(256 * n, dtype=np.float32) / 100, s)
y = jax.device_put(np.ones(256 * n, np.float32), s)
sums, reads = [], []
for i in range(24):
    x = f(x)
    sums.append(total(y + i))
    if i % 6 == 5:
        reads.append(np.asarray(x)[:4].copy())
emit("x", x)
emit("sums", jnp.stack(sums))
emit("reads", np.stack(reads))
""",
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_loops_never_waiting_match_local_jax(server, loop):
    compare(LOOPS[loop], server.address, rtol=2e-6, atol=1e-6)


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request):
    with LocalServer(**SHAPES[request.param]) as s:
        yield s
        assert s.alive(), f"the server died:\n{s.log()}"


@pytest.mark.parametrize("loop", ["donating-sum", "donating-train-step"])
def test_loops_on_the_default_fleet_and_two_slices(shaped, loop):
    compare(LOOPS[loop], shaped.address, rtol=2e-6, atol=1e-6)


# Every output of the step is donated to the next one: a worker that takes a donated shard
# for a finished program never holds back, and XLA:CPU's pool deadlocks as local jax does
# with hundreds of such steps in flight. So this is compared with numpy, not local jax.
DONATING_ONLY = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = len(jax.devices())
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
step = jax.jit(lambda state: state + jnp.sum(state) % 7 + 1, donate_argnums=0)
state = jax.device_put(np.arange(64 * n, dtype=np.int32), s)
for i in range(STEPS):
    state = step(state)                       # no wait, nothing kept but the state
emit("state", state)
"""


def test_a_loop_donating_all_it_returns_keeps_few_steps_in_flight(shaped):
    steps = 300
    got = run_snippet(DONATING_ONLY.replace("STEPS", str(steps)), shaped.address,
                      timeout=120)["state"]
    state = np.arange(got.size, dtype=np.int32)
    for _ in range(steps):
        state = state + np.sum(state) % 7 + 1
    np.testing.assert_array_equal(got, state)
