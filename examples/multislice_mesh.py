"""A mesh over several slices, the way multi-slice (Pathways) code builds it: plain jax.

    isthmus run --slices 2 --hosts-per-slice 2 --devices-per-host 2 -- \
        python examples/multislice_mesh.py

`jax.make_mesh` refuses backends with several slices; `create_hybrid_device_mesh` lays the
devices out by their `slice_index`: data parallel across slices, model parallel within one.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main():
    devices = jax.devices()
    slices = len({d.slice_index for d in devices})
    per_slice = len(devices) // slices
    grid = mesh_utils.create_hybrid_device_mesh((1, per_slice), (slices, 1), devices)
    mesh = Mesh(grid, ("data", "model"))
    print(f"mesh {dict(mesh.shape)}; row r holds slice r: "
          f"{[sorted({d.slice_index for d in row}) for row in grid]}")

    x = np.arange(slices * 4 * per_slice * 2, dtype=np.float32).reshape(slices * 4, per_slice * 2)
    w = np.ones((per_slice * 2, 3), np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    y = jax.jit(lambda a, b: jnp.tanh(a @ b / 100).sum(axis=0))(xs, ws)
    expected = np.tanh(x @ w / 100).sum(axis=0)
    print("result", np.asarray(y), "matches numpy:", bool(np.allclose(y, expected, rtol=1e-5)))


if __name__ == "__main__":
    main()
