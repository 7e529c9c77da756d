"""orbax's in-memory Snapshotter on isthmus, in bytes: save, then load onto one and two
slices, for a state of N arrays of M MiB; then the byte paths it uses, one at a time.

    isthmus run --slices 2 --hosts-per-slice 1 --devices-per-host 1 -- \
        python -m bench.snapshot_restore [N] [M]

(defaults 4 and 64). Prints GB/s of the state's bytes, medians of 3. Needs pathwaysutils and
orbax (the test extra). With many small arrays (the elastic LM's 205), `bench.elastic --model
lm-base` shows the per-request cost instead.
"""

import sys
import time

import numpy as np


def main() -> int:
    import jax
    import orbax.checkpoint as ocp
    import pathwaysutils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    pathwaysutils.initialize()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    devices = jax.devices()
    if len(devices) != 2:
        raise SystemExit("run it on 2 slices of 1 device (see the docstring)")

    def replicated(devs):
        return NamedSharding(Mesh(np.array(devs).reshape(len(devs), 1), ("slice", "data")), P())

    both, first, second = replicated(devices), replicated(devices[:1]), replicated(devices[1:])
    state = {f"w{i}": jax.device_put(np.full((mib << 18,), i, np.float32), both)
             for i in range(n)}
    jax.block_until_ready(state)
    nbytes = sum(a.nbytes for a in state.values())
    snapshotter = ocp.v1.training.pathways.Snapshotter()
    for target, name in ((first, "one slice"), (both, "two slices")):
        rates = []
        for _ in range(3):
            snapshotter.save(0, state)
            snapshotter.join()
            abstract = jax.tree.map(
                lambda a, t=target: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=t), state)
            began = time.perf_counter()
            jax.block_until_ready(snapshotter.load(abstract))
            rates.append(nbytes / (time.perf_counter() - began) / 1e9)
        print(f"{n} x {mib} MiB, load onto {name}: {sorted(rates)[1]:.2f} GB/s", flush=True)

    def timed(what, move):
        began = time.perf_counter()
        out = jax.block_until_ready(move())
        print(f"  {what}: {nbytes / (time.perf_counter() - began) / 1e9:.2f} GB/s", flush=True)
        return out

    on_first = jax.block_until_ready(jax.device_put(state, first))
    host = timed("device -> pinned host, one worker",
                 lambda: jax.device_put(on_first, first.with_memory_kind("pinned_host")))
    timed("pinned host -> device, one worker", lambda: jax.device_put(host, first))
    timed("device -> the other worker's device", lambda: jax.device_put(on_first, second))
    return 0


if __name__ == "__main__":
    sys.exit(main())
