"""Real work on a TPU, run once on local jax and once through isthmus (bench/tpu_check.py
compares them): prints one JSON object of results and figures.

    python bench/tpu_work.py [--quick] [--only=PART,...]

Results (compared bit for bit, where the program is the same): the MLP's losses
(784-512-512-10, batch 128, SGD, 200 steps), a bf16 matmul's checksum, a Pallas TPU kernel's
output, an array through host memory (memory_kind="pinned_host") and back, a donating loop's
final state, the Flax NNX language model's losses (where flax is installed); a colocated
Python function's output is checked against numpy. Figures (compared as ratios): MLP steps/s
(pipelined, never waiting, for 2 s), a tiny jit + fetch's p50, 256 MiB device_put and fetch in GB/s,
a large bf16 matmul's TFLOP/s (10 in flight at a time) and the language model's time.

Through isthmus (JAX_PLATFORMS=proxy) `pathwaysutils.initialize()` runs first, so that an
Orbax checkpoint's shards are written and read by the workers (pathwaysutils' persistence,
with ENABLE_PATHWAYS_PERSISTENCE=1); on local jax Orbax writes them itself. Either way the
restored state's bytes are compared. A profile of a step (through isthmus: pathwaysutils'
`profileRequest` plugin program into a local directory, as its `start_trace` sends it for
gs:// locations; locally: `jax.profiler.trace`) must name the step's program.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def mlp_update(params, x, y):
    """One SGD step of the MLP (softmax cross-entropy): the new parameters and the loss.
    bench/step_timeline.py times the same step."""
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = params[-1]
        logits = x @ w + b
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))

    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value


def mlp_init(sizes: list[int]) -> list:
    """examples/train_mlp.py's parameters for layers of `sizes`."""
    import pathlib

    import jax

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    from train_mlp import init

    return init(jax.random.key(0), sizes)


def mlp(steps: int, seconds: float = 2.0) -> dict:
    import jax

    step = jax.jit(mlp_update)

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, 128, 784)).astype(np.float32)
    ys = np.eye(10, dtype=np.float32)[rng.integers(0, 10, (8, 128))]
    data = [(jax.device_put(x), jax.device_put(y)) for x, y in zip(xs, ys)]
    params = mlp_init([784, 512, 512, 10])
    losses = []
    for i in range(steps):  # the losses, each read
        params, value = step(params, *data[i % len(data)])
        losses.append(float(value))
    # Steps/s, never waiting, for `seconds`, the last 50 losses kept as a loop that logs
    # them keeps them (bench/step_timeline.py's loop). A burst of 200 steps (50 ms locally)
    # weighed the pipeline's fill and drain, a few ms through isthmus, as much as its rate.
    values: list = []
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for i in range(50):
            params, value = step(params, *data[(done + i) % len(data)])
            values.append(value)
        done += 50
        values = values[-50:]
    jax.block_until_ready(values)  # each step reads the last: all have run
    rate = done / (time.perf_counter() - start)
    return {"mlp_losses": losses, "mlp_steps_per_s": rate}


def tiny_round_trip(count: int) -> dict:
    """bench/round_trip.py's parts: a jit and a wait, a jit and a fetch, a fetch of a
    computed result (p50 ms of `count` each)."""
    from round_trip import measure

    parts = measure(count, ("jit_block", "jit_fetch", "fetch_ready"))
    return {f"{part}_p50_ms": parts[part] for part in ("jit_block", "jit_fetch", "fetch_ready")}


def transfers(mib: int) -> dict:
    import jax

    host = np.random.default_rng(1).standard_normal(mib << 18).astype(np.float32)
    jax.device_put(host[:1024]).block_until_ready()
    puts, fetches = [], []
    for _ in range(3):
        start = time.perf_counter()
        on_chip = jax.device_put(host)
        on_chip.block_until_ready()
        puts.append(time.perf_counter() - start)
        start = time.perf_counter()
        back = np.asarray(on_chip)
        fetches.append(time.perf_counter() - start)
        del on_chip
    assert np.array_equal(back, host)
    size = host.nbytes / 1e9
    return {"put_GBps": size / statistics.median(puts),
            "fetch_GBps": size / statistics.median(fetches)}


def matmul(n: int) -> dict:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    times = []
    for _ in range(5):  # 10 products in flight, then waited: as a training loop runs them
        start = time.perf_counter()
        jax.block_until_ready([f(a, b) for _ in range(10)])
        times.append((time.perf_counter() - start) / 10)
    small = np.asarray(jax.jit(lambda a, b: (a[:512, :512] @ b[:512, :512]).astype(
        jnp.float32))(a, b))
    return {"matmul_tflops": 2 * n ** 3 / statistics.median(times) / 1e12,
            "matmul_checksum": small.tobytes().hex()[:64] + f"...{float(small.sum()):.6e}",
            "matmul_small": small}


def pallas() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    y = jnp.ones((8, 128), jnp.float32)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)
    return {"pallas": np.asarray(out)}


def _through_isthmus() -> bool:
    import os

    return os.environ.get("JAX_PLATFORMS") == "proxy"


def colocated() -> dict:
    """A colocated Python function on the chip's colocated CPU device, checked against numpy
    (through isthmus only: local jax has no colocated CPU devices)."""
    import jax

    if not _through_isthmus():
        return {}
    from jax.experimental import colocated_python as cp

    (cpu,) = cp.colocated_cpu_devices(jax.devices()[:1])

    @cp.colocated_python
    def scale(x):
        return x * 2 + 1

    x = jax.device_put(np.arange(16, dtype=np.float32), cpu)
    out = np.asarray(scale(x))
    return {"colocated": out, "colocated_expected": np.arange(16, dtype=np.float32) * 2 + 1}


def host_offload() -> dict:
    import jax
    from jax.sharding import SingleDeviceSharding

    device = jax.devices()[0]
    x = jax.device_put(np.arange(1024, dtype=np.float32), device)
    host = jax.device_put(x, SingleDeviceSharding(device, memory_kind="pinned_host"))
    back = jax.device_put(host, SingleDeviceSharding(device, memory_kind="device"))
    return {"offload": np.asarray(jax.jit(lambda v: v * 3)(back)),
            "offload_kind": host.sharding.memory_kind}


def donating_loop(steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    def update(state, x):
        return state * 0.5 + (jnp.tanh(x) @ state[:128, :128].T).sum(0)

    donating = jax.jit(update, donate_argnums=0)
    state = jnp.ones((256, 128), jnp.float32)
    x = jnp.linspace(-1, 1, 128 * 128, dtype=jnp.float32).reshape(128, 128)
    for _ in range(steps):
        state = donating(state, x)
    return {"donating": np.asarray(state)}


def checkpoint() -> dict:
    """An Orbax CheckpointManager round trip of a small train state on the chip (two steps
    saved, max_to_keep=1, the latest restored by a new manager from abstract targets): the
    restored leaves' bytes (where orbax is installed)."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("orbax") is None:
        return {}
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    def init():
        k1, k2 = jax.random.split(jax.random.key(3))
        return {"w": jax.random.normal(k1, (256, 512), jnp.float32),
                "emb": jax.random.normal(k2, (64, 128), jnp.bfloat16),
                "b": jnp.arange(512, dtype=jnp.int32) - 7, "step": jnp.array(0, jnp.int32)}

    @jax.jit
    def update(state):
        return {"w": state["w"] * 0.5 + jnp.tanh(state["w"]),
                "emb": (state["emb"] * 1.5).astype(jnp.bfloat16),
                "b": state["b"] + state["step"], "step": state["step"] + 1}

    # pathwaysutils' persistence restores onto NamedShardings only.
    placed = jax.sharding.NamedSharding(jax.make_mesh((1,), ("x",), devices=jax.devices()[:1]),
                                        jax.sharding.PartitionSpec())
    state = jax.jit(init, out_shardings=placed)()
    with tempfile.TemporaryDirectory() as directory:
        options = ocp.CheckpointManagerOptions(max_to_keep=1)
        with ocp.CheckpointManager(directory, options=options) as manager:
            for step in range(2):
                state = update(state)
                manager.save(step, args=ocp.args.StandardSave(state))
            manager.wait_until_finished()
        with ocp.CheckpointManager(directory) as manager:
            steps = list(manager.all_steps())
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=placed), state)
            restored = manager.restore(manager.latest_step(),
                                       args=ocp.args.StandardRestore(target))
    leaves = {name: np.asarray(restored[name]) for name in sorted(restored)}
    assert all(np.array_equal(leaves[k], np.asarray(state[k])) for k in leaves), "restore"
    return {"checkpoint_steps": steps,
            "checkpoint": {k: v.tobytes().hex()[:4096] + f"...{v.nbytes}"
                           for k, v in leaves.items()}}


PROFILE_REQUEST = ('{{"profileRequest": {{"traceLocation": "{0}", "maxNumHosts": 8, '
                   '"includeResourceManagers": true, "xprofTraceOptions": {{'
                   '"traceDirectory": "{0}", "traceSessionName": "tpu_check"}}}}}}')


def profile() -> dict:
    """A profile of two steps: whether its traces name the step's program (and, for the
    record, which hosts wrote one and whether a TPU plane is in it)."""
    import pathlib
    import tempfile

    import jax
    import jax.numpy as jnp

    @jax.jit
    def profiled_step_fn(x):
        return jnp.sin(x) * 2 + x.sum(axis=1, keepdims=True)

    x = jnp.ones((256, 256), jnp.float32)
    profiled_step_fn(x).block_until_ready()
    with tempfile.TemporaryDirectory() as directory:
        if _through_isthmus():
            from jax.extend import backend, ifrt_programs
            from jax.interpreters import pxla

            programs = ifrt_programs.ifrt_programs
            client = jax.devices()[0].client
            executable = client.compile_ifrt_program(
                programs.make_plugin_program(PROFILE_REQUEST.format(directory)),
                programs.make_plugin_compile_options())
            avals = [jax.core.ShapedArray((1,), jnp.object_)]
            shardings = [jax.sharding.SingleDeviceSharding(backend.get_default_device())]

            def call():
                results = executable.execute_sharded([], with_tokens=True)
                results.consume_with_handlers(
                    pxla.global_avals_to_results_handler(avals, shardings, True).handlers)
                results.consume_token().block_until_ready()

            call()  # started
            for _ in range(2):
                profiled_step_fn(x).block_until_ready()
            call()  # stopped: written
        else:
            with jax.profiler.trace(directory):
                for _ in range(2):
                    profiled_step_fn(x).block_until_ready()
        traces = {p.name: p.read_bytes()
                  for p in pathlib.Path(directory).glob("plugins/profile/*/*.xplane.pb")}
    return {"profile_names_program": any(b"profiled_step_fn" in d for d in traces.values()),
            "profile_hosts": sorted(traces),
            "profile_tpu_plane": any(b"/device:TPU:0" in d for d in traces.values())}


def flax_lm() -> dict:
    """The workloads tier's Flax NNX language model (tests/workloads/scripts/flax_nnx_lm.py)
    on a 1 x 1 mesh: its 20 losses and its parameters' checksum (where flax is installed)."""
    import importlib.util
    import pathlib

    if importlib.util.find_spec("flax") is None:
        return {}
    path = pathlib.Path(__file__).parent.parent / "tests/workloads/scripts/flax_nnx_lm.py"
    spec = importlib.util.spec_from_file_location("flax_nnx_lm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reported: dict = {}
    stamps: dict = {}

    def report(name, value):
        reported[name] = value
        stamps[name] = time.perf_counter()

    module.report = report
    start = time.perf_counter()
    module.main((1, 1))
    took = time.perf_counter() - start
    losses = [f"loss/{i}" for i in range(module.STEPS)]
    steps = [stamps[b] - stamps[a] for a, b in zip(losses, losses[1:])]
    return {"lm_losses": [reported[name] for name in losses],
            "lm_param_abs_sum": reported["param_abs_sum"], "lm_seconds": took,
            # Where the time goes: the model's and optimizer's making, the first step's
            # compile and the first loss read; a later step (each reads its loss); the end.
            "lm_first_s": stamps[losses[0]] - start,
            "lm_step_ms": statistics.median(steps) * 1e3,
            "lm_tail_s": start + took - stamps[losses[-1]]}


def main() -> None:
    import jax

    quick = "--quick" in sys.argv
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")),
                None)  # --only=lm,mlp: those parts alone
    if _through_isthmus():
        try:  # before jax makes its backend, as its users call it
            import pathwaysutils

            pathwaysutils.initialize()
        except ImportError:
            pass
    out: dict = {"device_kind": jax.devices()[0].device_kind, "backend":
                 jax.devices()[0].client.platform_version.split("\n")[0]}
    for name, part in (("mlp", lambda: mlp(200)), ("pallas", pallas),
                       ("colocated", colocated),
                       ("offload", host_offload), ("donating", lambda: donating_loop(50)),
                       ("tiny", lambda: tiny_round_trip(100 if quick else 300)),
                       ("transfers", lambda: transfers(64 if quick else 256)),
                       ("matmul", lambda: matmul(4096 if quick else 8192)),
                       ("checkpoint", checkpoint), ("profile", profile),
                       ("lm", flax_lm)):
        if only is not None and name not in only:
            continue
        try:
            out.update(part())
        except Exception as e:  # noqa: BLE001 - reported, and compared as a failure
            import traceback

            out[f"{name}_error"] = (f"{type(e).__name__}: {str(e)[:1500]}\n"
                                    + "".join(traceback.format_exc()[-2500:]))
    for key, value in list(out.items()):
        if isinstance(value, np.ndarray):
            out[key] = {"dtype": str(value.dtype), "shape": list(value.shape),
                        "hex": value.tobytes().hex()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
