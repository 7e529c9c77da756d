"""A small Flax NNX language model, trained the way Flax's NNX examples do it.

A decoder-only transformer (token and position embeddings, two attention + MLP blocks, a
vocabulary head) whose parameters carry sharding annotations (`nnx.with_partitioning`) on a
2-D ("data", "model") mesh over the 8 devices; built under `jax.set_mesh`, so Flax shards
each variable as it creates it. Trained with optax (AdamW through `nnx.Optimizer`) for 20
steps on synthetic token sequences, the batch sharded over "data", with `nnx.jit` donating
the model and the optimizer. Prints the loss after each step and a checksum of the trained
parameters.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, HEADS, FF, LAYERS, SEQ, BATCH, STEPS = 128, 64, 4, 128, 2, 32, 16, 20


def report(name, value):
    print("WORKLOAD " + json.dumps({"name": name, "value": value}), flush=True)


dense_init = nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, "model"))
bias_init = nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",))


class TransformerBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=EMBED, kernel_init=dense_init, bias_init=bias_init,
            decode=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(EMBED, epsilon=1e-6, rngs=rngs)
        self.up = nnx.Linear(EMBED, FF, kernel_init=dense_init, bias_init=bias_init, rngs=rngs)
        self.down = nnx.Linear(
            FF, EMBED, rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), ("model", None)),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (None,)))
        self.norm2 = nnx.LayerNorm(EMBED, epsilon=1e-6, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = self.norm1(x + self.attention(x, mask=mask))
        h = jax.lax.with_sharding_constraint(nnx.gelu(self.up(x)), P("data", None, "model"))
        return self.norm2(x + self.down(h))


class MiniLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        embed_init = nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "model"))
        self.tokens = nnx.Embed(VOCAB, EMBED, embedding_init=embed_init, rngs=rngs)
        self.positions = nnx.Embed(SEQ, EMBED, embedding_init=embed_init, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(EMBED, VOCAB, kernel_init=dense_init, bias_init=bias_init,
                               rngs=rngs)

    def __call__(self, tokens):
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model, inputs, targets):
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit(donate_argnums=(0, 1))
def train_step(model: MiniLM, optimizer: nnx.Optimizer, inputs, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss


def batches():
    """Sequences of a fixed affine recurrence mod VOCAB from random starts: learnable."""
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        start = rng.integers(0, VOCAB, (BATCH, 1))
        stride = rng.integers(1, 4, (BATCH, 1))
        seq = (start + stride * np.arange(SEQ + 1)[None]) % VOCAB
        yield seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def main(shape=(2, 4)):
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    data_sharding = NamedSharding(mesh, P("data", None))
    with jax.set_mesh(mesh):
        model = MiniLM(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
        kernel = model.blocks[0].up.kernel[...]
        assert kernel.sharding.is_equivalent_to(
            NamedSharding(mesh, P(None, "model")), kernel.ndim), kernel.sharding
        for step, (inputs, targets) in enumerate(batches()):
            inputs = jax.device_put(inputs, data_sharding)
            targets = jax.device_put(targets, data_sharding)
            loss = train_step(model, optimizer, inputs, targets)
            report(f"loss/{step}", float(loss))
        params = nnx.state(model, nnx.Param)
        leaves = jax.tree.leaves(params)
        report("param_abs_sum", float(sum(jnp.abs(x).sum() for x in leaves)))
        report("param_count", int(sum(x.size for x in leaves)))


if __name__ == "__main__":
    main()
