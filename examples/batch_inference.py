"""Batch inference: a model sharded over one slice serves a stream of batches. Plain jax.

    isthmus run --slices 2 --hosts-per-slice 1 --devices-per-host 4 -- \
        python examples/batch_inference.py

The model's weights are split over the slice's devices (model parallel: each device holds a
column block of every layer); requests arrive as numpy batches. The loop keeps the devices
busy the way jax allows from one process: it puts and starts the next batch before reading
the one before (`copy_to_host_async`, then `np.asarray`), so the transfers and the compute of
neighbouring batches overlap. Works on local jax too (there the first half of the devices
stands for slice 0).

Prints one JSON line: batches served, a checksum of every answer (the same on local jax and on
any fleet), and batches per second.
"""

import json
import os
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCHES = int(os.environ.get("INFER_BATCHES", "40"))
ROWS, WIDTH, LAYERS = 32, 256, 3


def one_slice(devices):
    """The devices of slice 0 (or the first half of one slice's)."""
    first = [d for d in devices if getattr(d, "slice_index", 0) == 0]
    return first if len(first) < len(devices) else devices[:max(1, len(devices) // 2)]


@jax.jit
def serve(layers, x):
    for w in layers:
        x = jax.nn.gelu(x @ w)
    return jax.nn.softmax(x, axis=-1)


def main():
    devices = one_slice(jax.devices())
    mesh = Mesh(np.array(devices), ("model",))
    columns = NamedSharding(mesh, P(None, "model"))  # each device: a block of columns
    rows = NamedSharding(mesh, P())  # every device sees the whole batch
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / WIDTH ** 0.5
               for _ in range(LAYERS)]
    layers = jax.device_put(weights, columns)

    requests = (rng.standard_normal((ROWS, WIDTH)).astype(np.float32) for _ in range(BATCHES))
    answers, in_flight = [], None
    start = time.perf_counter()
    for batch in requests:
        out = serve(layers, jax.device_put(batch, rows))  # starts at once
        out.copy_to_host_async()
        if in_flight is not None:
            answers.append(np.asarray(in_flight))  # the one before, while this one runs
        in_flight = out
    answers.append(np.asarray(in_flight))
    rate = len(answers) / (time.perf_counter() - start)
    # Each answer weighted by its column and its place in the stream: a swapped batch, row
    # or column changes it.
    ramp = np.arange(1, WIDTH + 1, dtype=np.float64)
    checksum = float(sum((a @ ramp).sum() * (i + 1) for i, a in enumerate(answers)))
    print(json.dumps({"batches": len(answers), "checksum": checksum,
                      "first_row": answers[0][0, :4].tolist(), "batches_per_s": rate,
                      "devices": len(devices)}))


if __name__ == "__main__":
    main()
