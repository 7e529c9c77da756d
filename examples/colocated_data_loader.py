"""A data loader that runs on the workers: batches are made where they are used.

With `jax.experimental.colocated_python`, the loader below is an object that lives on every
host of the mesh (created there at its first call). Each call makes the next batch on the
hosts, each host only the rows of its own devices, and hands it to the training step as a
sharded jax.Array; the client never holds the data. Plain jax, no isthmus imports:

    isthmus run -- python examples/colocated_data_loader.py

or locally (JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python
examples/colocated_data_loader.py) to compare. It trains once with batches made on the hosts
and once with the same batches made in the client, and checks that the losses agree.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import colocated_python as cp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH, FEATURES, STEPS = 64, 16, 40


def batch_at(seed, step):
    """The batch of one step: the same numbers wherever it is made."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((BATCH, FEATURES), dtype=np.float32)
    y = (x @ np.linspace(-1, 1, FEATURES, dtype=np.float32))[:, None] + 0.1
    return x, y


@cp.colocated_python_class
class Loader:
    """Runs on the hosts: remembers its position between calls."""

    def __init__(self, seed, sharding):
        self.seed, self.sharding, self.step = seed, sharding, 0

    def next(self, token):
        x, y = batch_at(self.seed, self.step)
        self.step += 1
        # Each host fills only the shards of its own devices.
        make = jax.make_array_from_callback
        return (make(x.shape, self.sharding, lambda index: x[index]),
                make(y.shape, self.sharding, lambda index: y[index]))


def train(next_batch, mesh):
    replicated = NamedSharding(mesh, P())
    params = jax.device_put((jnp.zeros((FEATURES, 1)), jnp.zeros(1)), replicated)

    @jax.jit
    def step(params, x, y):
        def loss_fn(p):
            return jnp.mean((x @ p[0] + p[1] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), loss

    losses = []
    for i in range(STEPS):
        params, loss = step(params, *next_batch(i))
        losses.append(loss)
    return [float(v) for v in losses]


def main():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, P("x"))
    # The loader runs on the colocated CPU devices of the same hosts: on a CPU fleet every
    # device is its own, on accelerators each has a CPU device beside it.
    cpu_mesh = Mesh(np.array(cp.colocated_cpu_devices(devices)), ("x",))
    loader = Loader(0, NamedSharding(cpu_mesh, P("x")))
    token = jax.device_put(np.zeros(()), NamedSharding(cpu_mesh, P()))

    start = time.perf_counter()
    # device_put moves each host's rows to its own accelerators (nothing, on a CPU fleet).
    on_hosts = train(lambda i: jax.device_put(loader.next(token), rows), mesh)
    hosts_s = time.perf_counter() - start

    start = time.perf_counter()
    in_client = train(lambda i: jax.device_put(batch_at(0, i), rows), mesh)
    client_s = time.perf_counter() - start

    print(f"{len(devices)} devices; {STEPS} steps: batches made on the hosts {hosts_s:.2f} s, "
          f"in the client {client_s:.2f} s")
    print(f"loss {on_hosts[0]:.4f} -> {on_hosts[-1]:.4f}")
    np.testing.assert_allclose(on_hosts, in_client, rtol=1e-6)
    print("the same losses either way")


if __name__ == "__main__":
    main()
