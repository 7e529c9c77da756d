"""Each host writes its own shards to files: a checkpoint that never passes through the client.

A colocated Python function runs on every host of an array's devices with that host's
shards; here it saves each shard as `.npy` beside a small index (which box of the global
array it holds), and a second function reads them back onto the same devices. Plain jax, no
isthmus imports:

    isthmus run -- python examples/colocated_checkpoint_writer.py [DIRECTORY]

(the workers of a local fleet share this machine's file system; on a cluster, give a
directory that every host mounts). It checks that the restored array equals the saved one.
"""

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import colocated_python as cp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def box(index, shape):
    return [[s.start or 0, shape[d] if s.stop is None else s.stop]
            for d, s in enumerate(index)]


def make_writer(directory):
    @cp.colocated_python
    def write(x):
        sizes = []
        for shard in x.addressable_shards:
            name = os.path.join(directory, f"shard-{shard.device.id}")
            data = np.asarray(shard.data)
            np.save(name + ".npy", data)
            with open(name + ".json", "w") as f:
                json.dump({"box": box(shard.index, x.shape), "pid": os.getpid()}, f)
            sizes.append(jax.device_put(np.array([data.nbytes]), shard.device))
        # One number per device: the bytes it wrote.
        return jax.make_array_from_single_device_arrays(
            (len(x.sharding.device_set),), NamedSharding(x.sharding.mesh, P("x")), sizes)
    return write


def make_reader(directory):
    @cp.colocated_python
    def read(like):
        def load(index):
            for shard in like.addressable_shards:
                if shard.index == index:
                    return np.load(os.path.join(directory, f"shard-{shard.device.id}.npy"))
            raise KeyError(index)
        return jax.make_array_from_callback(like.shape, like.sharding, load)
    return read


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="checkpoint-")
    devices = jax.devices()
    rows = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    params = jax.jit(lambda: jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 7,
                     out_shardings=rows)()
    # The writer runs on the colocated CPU devices: on accelerators, device_put copies each
    # shard to the CPU of its own host (on a CPU fleet the devices are the same).
    cpu_rows = NamedSharding(Mesh(np.array(cp.colocated_cpu_devices(devices)), ("x",)),
                             P("x"))
    written = np.asarray(make_writer(directory)(jax.device_put(params, cpu_rows)))
    writers = {json.load(open(os.path.join(directory, f)))["pid"]
               for f in os.listdir(directory) if f.endswith(".json")}
    print(f"{written.sum()} bytes in {len(written)} shards, written by {len(writers)} "
          f"process(es); by this one: {os.getpid() in writers}")

    # Restore onto the same devices (the `like` array gives the shape and sharding).
    like = jax.device_put(np.zeros(params.shape, np.float32), cpu_rows)
    restored = jax.device_put(make_reader(directory)(like), rows)
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(params))
    print(f"restored from {directory}: equal to the saved array")


if __name__ == "__main__":
    main()
