"""An Orbax CheckpointManager round trip through a fresh process, with pathwaysutils.

`save DIR`: builds a sharded train-state-like pytree on a 2-D ("data", "model") mesh over
the 8 devices, advances it three steps with a jitted update and saves each step with a
CheckpointManager (max_to_keep=2, so step 0 is deleted), printing a checksum of every leaf
of every saved step. `restore DIR`: in a new process, a new CheckpointManager on DIR lists
the steps and restores the latest and the one before it from abstract targets (shapes,
dtypes and shardings only; the latest onto other shardings than it was saved with),
printing the same checksums. `pathwaysutils.initialize()` is called first, as its users do:
with JAX_PLATFORMS=proxy and ENABLE_PATHWAYS_PERSISTENCE=1 it registers its persistence
handler for jax.Array, so the workers write and read the shards; on local jax it does
nothing and orbax's own handler is used.
"""

import json
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pathwaysutils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

pathwaysutils.initialize()

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
STEPS = 3


def report(name, value):
    print("WORKLOAD " + json.dumps({"name": name, "value": value}), flush=True)


mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
SAVED_SPECS = {"params": {"w": P("data", "model"), "b": P("model"), "emb": P(None, "model")},
               "opt": {"mu": P("data", "model")}, "step": P()}
# Where the restore of the latest step puts each leaf: other boxes than those saved.
OTHER_SPECS = {"params": {"w": P("model", "data"), "b": P(), "emb": P("model", None)},
               "opt": {"mu": P(None, "data")}, "step": P()}


def shardings(specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


def init():
    keys = jax.random.split(jax.random.key(0), 3)
    return {"params": {"w": jax.random.normal(keys[0], (64, 32), jnp.float32),
                       "b": jnp.arange(32, dtype=jnp.int32) * 3 - 7,
                       "emb": jax.random.normal(keys[1], (16, 8), jnp.bfloat16)},
            "opt": {"mu": jax.random.uniform(keys[2], (64, 32), jnp.float32)},
            "step": jnp.array(0, jnp.int32)}


def update(state):
    p, mu = state["params"], state["opt"]["mu"]
    mu = 0.9 * mu + 0.1 * jnp.tanh(p["w"])
    return {"params": {"w": p["w"] - 0.01 * mu, "b": p["b"] + state["step"],
                       "emb": (p["emb"] * 1.5).astype(jnp.bfloat16)},
            "opt": {"mu": mu}, "step": state["step"] + 1}


def checksums(prefix, state):
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        host = np.asarray(leaf)
        report(f"{prefix}/{name}/sum", float(host.astype(np.float64).sum()))
        report(f"{prefix}/{name}/crc32", zlib.crc32(host.tobytes()))


def save():
    saved = shardings(SAVED_SPECS)
    state = jax.jit(init, out_shardings=saved)()
    step_fn = jax.jit(update, out_shardings=saved)
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(DIRECTORY, options=options) as manager:
        for step in range(STEPS):
            manager.save(step, args=ocp.args.StandardSave(state))
            checksums(f"step{step}", state)
            state = step_fn(state)
        manager.wait_until_finished()
        report("steps", manager.all_steps())


def restore():
    abstract = jax.eval_shape(init)
    with ocp.CheckpointManager(DIRECTORY) as manager:
        report("steps", manager.all_steps())
        latest = manager.latest_step()
        for step, specs in ((latest - 1, SAVED_SPECS), (latest, OTHER_SPECS)):
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                abstract, shardings(specs))
            state = manager.restore(step, args=ocp.args.StandardRestore(target))
            for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
                assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim), (
                    leaf.sharding, want.sharding)
                assert leaf.dtype == want.dtype, (leaf.dtype, want.dtype)
            checksums(f"step{step}", state)


{"save": save, "restore": restore}[MODE]()
