"""A training loop measured inside one client process (local jax or isthmus), for gpu_check.

value_and_grad + SGD on an MLP, data parallel over the first `devices` devices, a fixed
batch per step from numpy. Prints one JSON object with the steps per second and the final
loss and parameter checksum as exact hex floats, so that runs can be compared bit for bit.

    python bench/gpu_train.py STEPS DEVICES WIDTHS   (WIDTHS like 1024,4096,4096,1024)
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main() -> None:
    steps, devices = int(sys.argv[1]), int(sys.argv[2])
    widths = [int(w) for w in sys.argv[3].split(",")]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    params = [(jax.device_put((rng.standard_normal((a, b)) * (2 / a) ** 0.5).astype(np.float32),
                              replicated),
               jax.device_put(np.zeros(b, np.float32), replicated))
              for a, b in zip(widths[:-1], widths[1:])]
    rows = 64 * devices
    x = jax.device_put(rng.standard_normal((rows, widths[0])).astype(np.float32), batch)
    y = jax.device_put(rng.standard_normal((rows, widths[-1])).astype(np.float32), batch)

    def loss(params, x, y):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = params[-1]
        return jnp.mean((x @ w + b - y) ** 2)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    params, value = step(params, x, y)  # compile
    value.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        params, value = step(params, x, y)
    final = float(value)
    elapsed = time.perf_counter() - start
    checksum = float(sum(np.asarray(w, np.float64).sum() for w, _ in params))
    print(json.dumps({"steps_per_s": steps / elapsed, "final_loss": final.hex(),
                      "params_checksum": checksum.hex(), "platform": jax.devices()[0].platform,
                      "device_kind": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    main()
