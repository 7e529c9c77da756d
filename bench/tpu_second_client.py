"""A second TPU client in a live process (what a worker whose group re-forms does): whether
the first client's programs and buffers still work once the second exists, whether the
second runs programs, and whether it runs on once the first is gone. One JSON line of what
each step gave (or its error); bench/tpu_check.py prints it.

    JAX_PLATFORMS=cpu python bench/tpu_second_client.py
"""

from __future__ import annotations

import gc
import json
import os

os.environ["JAX_PLATFORMS"] = "cpu"  # jax's own backends off the chip, as in a worker

import jax
import numpy as np

from isthmus.compat import jax as jax_compat
from isthmus.worker.platforms import make_tpu_client

X = np.arange(1024, dtype=np.float32)
MODULE = jax.jit(lambda x: x * 2 + 1).lower(X).as_text()
WANT = X * 2 + 1


def run(client):
    """Compiles MODULE on the client's first chip, runs it on a buffer put there."""
    _jax, xc = jax_compat.jaxlib_extension(), jax_compat.xla_client()
    device = client.local_devices()[0]
    options = xc.CompileOptions()
    options.executable_build_options.device_assignment = xc.DeviceAssignment.create(
        np.array([[device.id]], dtype=np.int64))
    executable = client.compile_and_load(MODULE, _jax.DeviceList((device,)), options)
    buffer = jax.device_put(X, device)
    out = executable.execute_sharded([buffer]).disassemble_into_single_device_arrays()
    return bool(np.array_equal(np.asarray(out[0][0]), WANT)), buffer


def step(report, name, fn):
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        report[name] = f"error: {type(e).__name__}: {str(e).strip()[:300]}"


def main() -> None:
    report: dict = {}
    first = make_tpu_client()
    ok, kept = run(first)
    report["first runs"] = ok
    clients: dict = {}
    step(report, "second made while the first lives",
         lambda: clients.setdefault("second", make_tpu_client()).local_devices()[0]
         .device_kind)
    if "second" in clients:
        step(report, "second runs", lambda: run(clients["second"])[0])
        step(report, "first runs again", lambda: run(first)[0])
        step(report, "first's old buffer reads", lambda: bool(np.array_equal(
            np.asarray(kept), X)))
        del first, kept
        gc.collect()
        step(report, "second runs once the first is gone", lambda: run(clients["second"])[0])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
