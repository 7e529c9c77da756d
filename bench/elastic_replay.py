"""An elastic run of `examples/elastic_train.py`, replayed in local jax.

A run that lost slices computed each step on the slices that were up then; its losses
differ from an undisturbed run's (a step on fewer devices adds its reductions in another
order, and adam carries that on: 1-2% apart after a thousand steps, even with a single
redone stretch). This replays the same history, step for step on the same meshes, in one
local jax process with one CPU device per isthmus device, so that a chaos run can be
compared with local jax exactly.

    python -m bench.elastic_replay < SCHEDULE.json

reads {"steps": {step: [slices]}, "devices_per_slice": n, "slices": k, "batch_size": b,
"learning_rate": r} and prints {step: loss}. `replay()` runs that in a subprocess.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def schedule(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The slices each step's final computation ran on, from the run's JSON records: a
    step redone after a restore counts as its last record says, and the state every later
    step started from is that of those computations."""
    return {r["step"]: r["slices"] for r in records if r["kind"] == "step"}


def replay(steps: dict[int, list[int]], devices_per_slice: int, slices: int,
           batch_size: int = 64, learning_rate: float = 1e-3,
           timeout: float = 600.0) -> dict[int, float]:
    """Each step's loss in local jax along `steps` (see `schedule`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "IFRT_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_slice * slices}",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    request = {"steps": steps, "devices_per_slice": devices_per_slice, "slices": slices,
               "batch_size": batch_size, "learning_rate": learning_rate}
    done = subprocess.run([sys.executable, "-m", "bench.elastic_replay"], env=env, cwd=ROOT,
                          input=json.dumps(request), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the local replay failed:\n{done.stderr[-3000:]}")
    return {int(step): loss for step, loss in json.loads(done.stdout).items()}


def _run(request: dict[str, Any]) -> dict[int, float]:
    sys.path.insert(0, str(ROOT / "examples"))
    import jax
    import numpy as np
    import optax
    from elastic_train import batch_for_step, init_params, make_update
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    per_slice, devices = request["devices_per_slice"], jax.devices()
    optimizer = optax.adam(request["learning_rate"])
    update = make_update(optimizer)
    compiled: dict[tuple[int, ...], Any] = {}

    def on(slices: tuple[int, ...]) -> Any:  # the example's mesh over these slices
        if slices not in compiled:
            mesh = Mesh(np.array([devices[s * per_slice:(s + 1) * per_slice] for s in slices]),
                        ("slice", "data"))
            replicated = NamedSharding(mesh, P())
            compiled[slices] = (replicated, NamedSharding(mesh, P(("slice", "data"))),
                                jax.jit(update, out_shardings=(replicated, replicated)))
        return compiled[slices]

    steps = {int(step): tuple(slices) for step, slices in request["steps"].items()}
    replicated, _, _ = on(steps.get(1, tuple(range(request["slices"]))))
    params = jax.device_put(init_params(), replicated)
    state = {"params": params,
             "opt_state": jax.jit(optimizer.init, out_shardings=replicated)(params)}
    losses = {}
    for step in range(1, max(steps) + 1):
        replicated, batch, step_fn = on(steps[step])
        state = jax.device_put(state, replicated)
        x, y = batch_for_step(step, request["batch_size"])
        state, loss = step_fn(state, jax.device_put(x, batch), jax.device_put(y, batch))
        losses[step] = float(loss)
    return losses


if __name__ == "__main__":
    print(json.dumps(_run(json.load(sys.stdin))))
