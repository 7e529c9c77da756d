"""The data-parallel loop of issue 10, measured inside one client (local jax or isthmus), or
as its multi-controller twin (issue 27).

As users write it: a 3-layer MLP (16-64-64-1) with optax adam, a fresh numpy batch
`device_put` with a batch sharding every step, the loss read every 10 steps, over all the
devices jax sees. Prints one JSON object: steps per second (median of 3 windows) and the
median time of the synchronous pieces of one step (put, step, global sum, sum + fetch).

    python bench/dp_loop.py [STEPS]

The twin: with ISTHMUS_BENCH_PEER=COORDINATOR,PROCESSES,PROCESS_ID set (bench/peer.py sets
it), the process joins a `jax.distributed` job (XLA:CPU collectives over gloo) and runs the
same loop, model and global batch over the job's devices, each process making and feeding
only its own rows (`jax.make_array_from_process_local_data`), as multi-controller users do.
Process 0 prints the JSON.

With ISTHMUS_BENCH_FEED=colocated (a fleet), the batches are made on the workers instead, the
single-controller way (issue 27): a colocated Python loader on each host makes the rows of its
devices every step (`jax.make_array_from_callback`) and the client only `device_put`s the
result to the loop's sharding. The pieces (put, sum, ...) are measured as before.
"""

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def join_peer() -> tuple[int, int]:
    """Joins the multi-controller job named by ISTHMUS_BENCH_PEER; (processes, process id),
    or (1, 0) when there is none."""
    peer = os.environ.get("ISTHMUS_BENCH_PEER")
    if not peer:
        return 1, 0
    coordinator, processes, process_id = peer.split(",")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=int(processes),
                               process_id=int(process_id), initialization_timeout=120)
    return int(processes), int(process_id)


def colocated_feed(devices, rows, batch):
    """Batches made on the hosts by a colocated Python loader (module docstring)."""
    from jax.experimental import colocated_python as cp

    cpu = cp.colocated_cpu_devices(devices)
    cpu_mesh = Mesh(np.array(cpu), ("data",))
    cpu_rows, cpu_replicated = NamedSharding(cpu_mesh, P("data")), NamedSharding(cpu_mesh, P())

    @cp.colocated_python_class
    class Loader:
        def __init__(self, sharding, rows):
            # Every host draws the same batch and keeps the rows of its own devices.
            self.sharding, self.rows, self.rng = sharding, rows, np.random.default_rng(0)

        def next(self, token):
            x = self.rng.standard_normal((self.rows, 16)).astype(np.float32)
            y = np.sin(x[:, :1] * 2)
            return (jax.make_array_from_callback(x.shape, self.sharding, lambda i: x[i]),
                    jax.make_array_from_callback(y.shape, self.sharding, lambda i: y[i]))

    loader = Loader(cpu_rows, rows)
    token = jax.device_put(np.zeros((), np.float32), cpu_replicated)

    def feed():
        x, y = loader.next(token)
        return jax.device_put(x, batch), jax.device_put(y, batch)

    return feed


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    processes, process_id = join_peer()
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rows = 32 * len(devices)
    rng = np.random.default_rng(process_id)
    mine = rows // processes  # the rows this process makes (all of them in one client)

    def put(host):
        if processes == 1:
            return jax.device_put(host, batch)
        return jax.make_array_from_process_local_data(batch, host, (rows, *host.shape[1:]))

    def init(key):
        keys, sizes = jax.random.split(key, 3), [(16, 64), (64, 64), (64, 1)]
        return [{"w": jax.random.normal(k, s) * 0.1, "b": jnp.zeros(s[1])}
                for k, s in zip(keys, sizes)]

    def loss_fn(params, x, y):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            h = jax.nn.relu(h) if i < 2 else h
        return jnp.mean((h - y) ** 2)

    optimizer = optax.adam(1e-3)
    params = jax.device_put(init(jax.random.key(0)), replicated)
    state = jax.device_put(optimizer.init(params), replicated)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def batches():
        x = rng.standard_normal((mine, 16)).astype(np.float32)
        return x, np.sin(x[:, :1] * 2)

    def from_client():
        x, y = batches()
        return put(x), put(y)

    feed = (colocated_feed(devices, rows, batch)
            if os.environ.get("ISTHMUS_BENCH_FEED") == "colocated" else from_client)

    loss = None
    for _ in range(5):  # compile and warm up
        params, state, loss = step(params, state, *feed())
    float(loss)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        for i in range(steps // 3):
            params, state, loss = step(params, state, *feed())
            if i % 10 == 9:
                float(loss)
        float(loss)
        rates.append((steps // 3) / (time.perf_counter() - start))

    x, _ = batches()
    xs = put(x)
    elementwise = jax.jit(lambda a: a * 2 + 1)
    total = jax.jit(jnp.sum)
    elementwise(xs).block_until_ready()
    total(xs).block_until_ready()
    pieces = {"put": [], "elementwise": [], "sum": [], "sum_fetch": []}
    for _ in range(50):
        t = time.perf_counter()
        xs = put(x)
        xs.block_until_ready()
        pieces["put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        elementwise(xs).block_until_ready()
        pieces["elementwise"].append(time.perf_counter() - t)
        t = time.perf_counter()
        total(xs).block_until_ready()
        pieces["sum"].append(time.perf_counter() - t)
        t = time.perf_counter()
        float(total(xs))
        pieces["sum_fetch"].append(time.perf_counter() - t)
    if process_id:
        return
    print(json.dumps({"devices": len(devices), "processes": processes,
                      "steps_per_s": statistics.median(rates), "rates": rates,
                      **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in pieces.items()}}))


if __name__ == "__main__":
    main()
