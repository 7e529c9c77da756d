"""Equinox's autoparallelism example (docs/examples/parallelism.ipynb), as its users run it.

A small `eqx.nn.MLP` trained with optax's Adam on a batch sharded over all devices (the
model and optimizer state replicated, both placed with `eqx.filter_shard`), then evaluated
over the dataset. Two differences from the example: it does not force 8 CPU devices (the
devices are whatever jax has), and the step returns its loss so that each step's loss can
be printed. The one argument, `donate` or `keep`, says whether `eqx.filter_jit` donates
(`donate="all"` for the step and `donate="all-except-first"` for the evaluation, as in the
example) or not.
"""

import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.sharding as jshard
import numpy as np
import optax

DONATE = {"donate": True, "keep": False}[sys.argv[1]]


def report(name, value):
    print("WORKLOAD " + json.dumps({"name": name, "value": value}), flush=True)


# Hyperparameters
dataset_size = 64
channel_size = 4
hidden_size = 32
depth = 1
learning_rate = 3e-4
num_steps = 30
batch_size = 16  # must be a multiple of our number of devices.

# Generate some synthetic data
np.random.seed(0)
xs = np.random.normal(size=(dataset_size, channel_size))
ys = np.sin(xs)

model = eqx.nn.MLP(channel_size, channel_size, hidden_size, depth, key=jr.PRNGKey(6789))
optim = optax.adam(learning_rate)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))


def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return jnp.mean((y - pred_y) ** 2)


def train_dataloader(arrays, batch_size):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = np.arange(dataset_size)
    while True:
        perm = np.random.permutation(indices)
        start = 0
        end = batch_size
        while end <= dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


num_devices = len(jax.devices())
mesh = jax.make_mesh((num_devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
data_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec("batch"))
model_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec())


@eqx.filter_jit(donate="all" if DONATE else "none")
def train_step(model, opt_state, x, y):
    model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
    x, y = eqx.filter_shard((x, y), data_sharding)
    loss, grads = eqx.filter_value_and_grad(compute_loss)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
    return model, opt_state, loss


model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
for step, (x, y) in zip(range(1, num_steps + 1), train_dataloader((xs, ys), batch_size)):
    x, y = eqx.filter_shard((x, y), data_sharding)
    model, opt_state, loss = train_step(model, opt_state, x, y)
    report(f"loss/{step}", loss.item())


def eval_dataloader(arrays, batch_size):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    start = 0
    end = batch_size
    while start < dataset_size:
        yield tuple(array[start:end] for array in arrays)
        start = end
        end = start + batch_size


@eqx.filter_jit(donate="all-except-first" if DONATE else "none")
def evaluate(model, x, y):
    model = eqx.filter_shard(model, model_sharding)
    x, y = eqx.filter_shard((x, y), data_sharding)
    return compute_loss(model, x, y)


loss = 0
num_batches = 0
for x, y in eval_dataloader((xs, ys), batch_size):
    loss = loss + evaluate(model, x, y).item()
    num_batches = num_batches + 1
report("train_loss", loss / num_batches)
report("devices", num_devices)
