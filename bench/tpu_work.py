"""Real work on a TPU, run once on local jax and once through isthmus (bench/tpu_check.py
compares them): prints one JSON object of results and figures.

    python bench/tpu_work.py [--quick]

Results (compared bit for bit, where the program is the same): the MLP's losses
(784-512-512-10, batch 128, SGD, 200 steps), a bf16 matmul's checksum, a Pallas TPU kernel's
output, an array through host memory (memory_kind="pinned_host") and back, a donating loop's
final state, the Flax NNX language model's losses (where flax is installed); a colocated
Python function's output is checked against numpy. Figures (compared as ratios): MLP steps/s
(pipelined, never waiting), a tiny jit + fetch's p50, 256 MiB device_put and fetch in GB/s,
a large bf16 matmul's TFLOP/s (10 in flight at a time) and the language model's time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def mlp(steps: int) -> dict:
    import pathlib

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    from train_mlp import init

    def loss(params, x, y):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = params[-1]
        logits = x @ w + b
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, 128, 784)).astype(np.float32)
    ys = np.eye(10, dtype=np.float32)[rng.integers(0, 10, (8, 128))]
    data = [(jax.device_put(x), jax.device_put(y)) for x, y in zip(xs, ys)]
    params = init(jax.random.key(0), [784, 512, 512, 10])
    losses = []
    for i in range(steps):  # the losses, each read
        params, value = step(params, *data[i % len(data)])
        losses.append(float(value))
    values = []
    start = time.perf_counter()
    for i in range(steps):  # steps/s, never waiting
        params, value = step(params, *data[i % len(data)])
        values.append(value)
    jax.block_until_ready(values)
    rate = steps / (time.perf_counter() - start)
    return {"mlp_losses": losses, "mlp_steps_per_s": rate}


def tiny_round_trip(count: int) -> dict:
    import jax

    f = jax.jit(lambda x: x + 1)
    x = jax.device_put(np.float32(1))
    np.asarray(f(x))
    times = []
    for _ in range(count):
        start = time.perf_counter()
        np.asarray(f(x))
        times.append(time.perf_counter() - start)
    return {"jit_fetch_p50_ms": statistics.median(times) * 1e3}


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


def colocated() -> dict:
    """A colocated Python function on the chip's colocated CPU device, checked against numpy
    (local jax has no colocated CPU devices to compare with)."""
    import jax
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
    module.report = lambda name, value: reported.__setitem__(name, value)
    start = time.perf_counter()
    module.main((1, 1))
    took = time.perf_counter() - start
    return {"lm_losses": [reported[f"loss/{i}"] for i in range(module.STEPS)],
            "lm_param_abs_sum": reported["param_abs_sum"], "lm_seconds": took}


def main() -> None:
    import jax

    quick = "--quick" in sys.argv
    out: dict = {"device_kind": jax.devices()[0].device_kind, "backend":
                 jax.devices()[0].client.platform_version.split("\n")[0]}
    for name, part in (("mlp", lambda: mlp(200)), ("pallas", pallas),
                       ("colocated", colocated),
                       ("offload", host_offload), ("donating", lambda: donating_loop(50)),
                       ("tiny", lambda: tiny_round_trip(100 if quick else 300)),
                       ("transfers", lambda: transfers(64 if quick else 256)),
                       ("matmul", lambda: matmul(4096 if quick else 8192)),
                       ("lm", flax_lm)):
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
