"""A small data-parallel MLP training loop: plain jax, no isthmus imports.

Run it on a local isthmus fleet (the default: one slice of 2 worker processes x 4 CPU
devices) with

    isthmus run -- python examples/train_mlp.py

on the embedded backend (8 CPU devices in the server's own process) with
`isthmus run --devices 8 -- python examples/train_mlp.py`,

or locally (JAX_PLATFORMS=cpu python examples/train_mlp.py) to compare.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def init(key, sizes):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (fan_in, fan_out)) * (2 / fan_in) ** 0.5,
                       jnp.zeros(fan_out)))
    return params


def predict(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


@jax.jit
def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value


def main():
    devices = jax.devices()
    print(f"{len(devices)} devices, platform {devices[0].platform}, backend "
          f"{devices[0].client.platform_version}")
    mesh = Mesh(np.array(devices), ("data",))
    batch = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    rng = np.random.default_rng(0)
    true_w = rng.standard_normal((16, 1)).astype(np.float32)
    params = jax.device_put(init(jax.random.key(0), [16, 64, 64, 1]), replicated)
    start = time.perf_counter()
    for i in range(200):
        x = rng.standard_normal((8 * len(devices), 16)).astype(np.float32)
        y = np.sin(x @ true_w)
        params, value = step(params, jax.device_put(x, batch), jax.device_put(y, batch))
        if i % 50 == 0 or i == 199:
            print(f"step {i:3d}  loss {float(value):.5f}")
    print(f"200 steps in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
