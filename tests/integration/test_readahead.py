"""Small results a loop reads after every step are read ahead (controller/readahead.py):
each step's own values come back, never an earlier step's; reading one late, after later
steps ran, still gives its own step's value; an output read ahead and then donated or
deleted fails its read as it would without the read ahead. Compared with local jax."""

import numpy as np

from tests.integration.harness import compare, run_snippet

LOOP = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = len(jax.devices())
s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
@jax.jit
def step(x):
    y = jnp.tanh(x) * 1.5 + 0.25
    return y, jnp.sum(y), jnp.max(y), jnp.arange(3.0) * jnp.min(y)   # metrics: small
x = jax.device_put(np.linspace(-1, 1, 64 * n, dtype=np.float32), s)
sums, maxes, vecs, kept = [], [], [], []
for i in range(12):
    x, total, top, vec = step(x)
    sums.append(float(total)); maxes.append(float(top))       # read at once, every step
    vecs.append(np.asarray(vec))
    kept.append(total)                                         # ... and some read late
late = [float(t) for t in kept]
emit("sums", np.array(sums)); emit("maxes", np.array(maxes)); emit("vecs", np.stack(vecs))
emit("late", np.array(late)); emit("x", x)
"""


def test_a_loop_reads_each_steps_own_metrics(server):
    # A sum over devices of two workers adds in another order than one process: 1e-6.
    got = compare(LOOP, server.address, rtol=1e-6)
    assert len(set(got["sums"].tolist())) > 1  # the steps' values differ: no stale reuse


GONE = """
import jax, jax.numpy as jnp
step = jax.jit(lambda x: (x + 1.0, jnp.sum(x)))
bump = jax.jit(lambda t: t + 1.0, donate_argnums=0)
x = jnp.arange(8.0)
for i in range(4):        # the client reads the sum after each step: it is read ahead
    x, total = step(x)
    float(total)
x, total = step(x)
bumped = bump(total)      # donated before anyone read it
outcomes = []
try:
    float(total)
    outcomes.append(0)
except Exception as e:    # deleted or donated: the read fails
    outcomes.append(1 if "delete" in str(e).lower() or "donat" in str(e).lower() else 2)
x, total = step(x)
total.delete()
try:
    float(total)
    outcomes.append(0)
except Exception as e:
    outcomes.append(1 if "delete" in str(e).lower() else 2)
emit("outcomes", np.array(outcomes)); emit("bumped", bumped); emit("x", x)
"""


def test_a_result_read_ahead_then_donated_or_deleted_fails_its_read(server):
    got = run_snippet(GONE, server.address)
    assert got["outcomes"].tolist() == [1, 1], got["outcomes"]
    # sum(0..7) + 8 * 4 before the fifth step's sum; the donated sum plus one
    np.testing.assert_array_equal(got["bumped"], np.float32(sum(range(8)) + 8 * 4 + 1))
    np.testing.assert_array_equal(got["x"], np.arange(8.0, dtype=np.float32) + 6)


WAITS = """
import jax, jax.numpy as jnp
step = jax.jit(lambda x: (x * 1.01 + 0.5, jnp.sum(x), jnp.max(x)))
x = jnp.arange(32.0)
tops, kept = [], []
for i in range(10):
    x, total, top = step(x)
    total.block_until_ready()      # waited for after every step: read ahead from the second
    jax.block_until_ready(top)
    kept.append(total)
    if i % 3 == 0:
        tops.append(float(top))    # ... read at once sometimes
sums = [float(t) for t in kept]    # ... and read late, after later steps ran
gone = []
x, total, top = step(x)
bumped = jax.jit(lambda t: t + 1.0, donate_argnums=0)(total)
try:
    total.block_until_ready()      # donated since: the wait fails as it would locally
    gone.append(0)
except Exception as e:
    gone.append(1 if "delete" in str(e).lower() or "donat" in str(e).lower() else 2)
emit("sums", np.array(sums)); emit("tops", np.array(tops)); emit("x", x)
emit("gone", np.array(gone)); emit("bumped", bumped)
"""


def test_a_loop_that_waits_for_its_metrics_gets_each_steps_own_values(server):
    got = compare(WAITS, server.address, rtol=1e-6)
    assert len(set(got["sums"].tolist())) == 10
