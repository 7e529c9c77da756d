"""Elastic data-parallel training on isthmus with unmodified pathwaysutils and orbax.

A 3-layer MLP trained with optax adam, data parallel over the slices that are up: params
and optimizer state are replicated on a ("slice", "data") mesh, each batch is split over all
its devices. The pieces that make it elastic are stock Pathways ones:

- `pathwaysutils.elastic.Manager.elastic_retry(minimum_slice_count=1)` reruns `train` when a
  step fails because a slice went down (DATA_LOSS), on the slices still up;
- `orbax.checkpoint.v1.training.pathways.Snapshotter` keeps a copy of {params, opt_state,
  step} in pinned host memory, one replica per slice, every `--snapshot-every` steps; every
  attempt after the first starts from it (`snapshotter.load`), on its own mesh;
- at each step boundary, a slice that came back (`manager.available_inactive_slices`)
  makes `train` snapshot and raise `ScaleUpSignalError`, and the next attempt uses it.

The batch of a step depends on the step index only, so a step redone after a restore sees
the same data, and the global batch size does not change with the number of slices: runs
with different failures compute the same losses up to the order of float additions.

    isthmus run --slices 2 --hosts-per-slice 1 --devices-per-host 1 -- \\
        python examples/elastic_train.py --steps 40

With JAX_PLATFORMS unset, `--controller HOST:PORT` connects through `isthmus.connect`.
`--model lm-base` trains a Flax NNX transformer language model (4 layers, 5.3 M parameters,
63 MB of state with adam's moments) instead of the MLP; `lm-small` is the workloads tier's
size. `--log-json PATH` writes one JSON record per line: `step` (step, loss, active slices,
wall time), `error` (an attempt that failed), `ready` (an attempt restored and compiled,
about to run its first step: seconds tracing the model's shapes, restoring, lowering and
compiling the step), `attempt` (when it ends: the same, the first step, how it ended) and a
final `summary`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, NamedTuple

import numpy as np

FEATURES = 16
HIDDEN = 64
SEED = 0


class JsonLog:
    """Appends one JSON record per line to a file (or nowhere), flushed at once, so that
    another process can follow the run while it goes."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "w") if path else None

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def batch_for_step(step: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of `step`: a function of the step index alone, never of the history."""
    teacher = np.random.default_rng(SEED).standard_normal((FEATURES, 1)).astype(np.float32)
    rng = np.random.default_rng([SEED, step])
    x = rng.standard_normal((global_batch, FEATURES)).astype(np.float32)
    return x, np.sin(x @ teacher)


def init_params() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(SEED + 1)
    sizes = [FEATURES, HIDDEN, HIDDEN, 1]
    return [((rng.standard_normal((n_in, n_out)) * (2 / n_in) ** 0.5).astype(np.float32),
             np.zeros(n_out, np.float32)) for n_in, n_out in zip(sizes[:-1], sizes[1:])]


def mlp_loss(params, x, y):
    import jax
    import jax.numpy as jnp

    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return jnp.mean((x @ w + b - y) ** 2)


def make_update(optimizer: Any, loss_fn: Any = mlp_loss) -> Any:
    """One training step, `update(state, x, y) -> (state, loss)` (to jit)."""
    import jax
    import optax

    def update(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    return update


class Model(NamedTuple):
    """What `train` needs of a model: its parameters placed with a sharding, its loss, and
    the batch of a step (numpy, a function of the step index alone)."""

    init: Any
    loss: Any
    batch: Any


def mlp_model() -> Model:
    import jax

    return Model(lambda sharding: jax.device_put(init_params(), sharding), mlp_loss,
                 batch_for_step)


# The language model of `--model lm`: a decoder-only transformer in Flax NNX (the workloads
# tier's, larger), its parameters a plain pytree for the snapshotter.
LM_SIZES = {  # vocabulary, width, heads, MLP width, layers, sequence length
    "small": (512, 64, 4, 128, 2, 32),
    "base": (4096, 256, 4, 1024, 4, 64),
}


def lm_model(size: str) -> Model:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    vocab, width, heads, hidden, layers, length = LM_SIZES[size]

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                                    decode=False, rngs=rngs)
            self.norm1 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, width, rngs=rngs)
            self.norm2 = nnx.LayerNorm(width, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = self.norm1(x + self.attention(x, mask=mask))
            return self.norm2(x + self.down(nnx.gelu(self.up(x))))

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.tokens = nnx.Embed(vocab, width, rngs=rngs)
            self.positions = nnx.Embed(length, width, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.head = nnx.Linear(width, vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LM(nnx.Rngs(SEED))))

    def init(sharding):
        return jax.jit(lambda: nnx.to_pure_dict(nnx.state(LM(nnx.Rngs(SEED)))),
                       out_shardings=sharding)()

    def loss(params, tokens, targets):
        logits = nnx.merge(graphdef, params)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def batch(step: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequences of an affine recurrence mod the vocabulary from random starts."""
        rng = np.random.default_rng([SEED, step])
        start = rng.integers(0, vocab, (global_batch, 1))
        stride = rng.integers(1, 4, (global_batch, 1))
        seq = (start + stride * np.arange(length + 1)[None]) % vocab
        return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)

    return Model(init, loss, batch)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="train steps 1..STEPS")
    parser.add_argument("--model", default="mlp", choices=["mlp", *(f"lm-{k}" for k in LM_SIZES)],
                        help="the model: a 3-layer MLP, or a Flax NNX transformer language "
                             "model (needs flax)")
    parser.add_argument("--snapshot-every", type=int, default=5,
                        help="snapshot {params, opt_state, step} after every K-th step")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between the elastic manager's slice health checks")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size, the same on any number of slices")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds to sleep after each step (to watch a run, or in tests)")
    parser.add_argument("--print-every", type=int, default=1, help="print every N-th step")
    parser.add_argument("--log-json", metavar="PATH", help="write JSON-lines records here")
    parser.add_argument("--controller", metavar="HOST:PORT",
                        help="connect with isthmus.connect (only when JAX_PLATFORMS is unset)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.snapshot_every < 1 or args.print_every < 1:
        parser.error("--steps, --snapshot-every and --print-every must be at least 1")
    return args


def connect(controller: str | None) -> None:
    """Points jax at isthmus: the environment `isthmus run` sets, or `--controller`."""
    if not os.environ.get("JAX_PLATFORMS") and controller:
        import isthmus

        isthmus.connect(controller)
    import pathwaysutils

    pathwaysutils.initialize()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    connect(args.controller)

    import jax
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from pathwaysutils.elastic import manager as elastic_manager

    log = JsonLog(args.log_json)
    optimizer = optax.adam(args.learning_rate)
    manager = elastic_manager.Manager()
    snapshotter = ocp.v1.training.pathways.Snapshotter()  # replica axis 0: "slice"
    per_slice = {len(devices) for devices in manager.slice_to_devices.values()}
    if len(per_slice) != 1 or any(args.batch_size % (n * count) for n in per_slice
                                  for count in range(1, manager.total_slice_count + 1)):
        raise SystemExit(f"--batch-size {args.batch_size} must split evenly over any number "
                         f"of slices of {sorted(per_slice)} devices")
    print(f"{len(jax.devices())} devices in {manager.total_slice_count} slices "
          f"{sorted(manager.all_slice_indices)}; up: {sorted(manager.active_slice_indices)}",
          flush=True)

    model = mlp_model() if args.model == "mlp" else lm_model(args.model.removeprefix("lm-"))
    update = make_update(optimizer, model.loss)

    # Everything `train` learns across attempts; the manager's retries call it afresh.
    run = {"attempt": 0, "event_at": None, "losses": {}, "attempts": [], "executed": 0}

    def on_event():  # after a slice-down error or a scale-up signal, before the next wait
        run["event_at"] = time.time()

    @manager.elastic_retry(minimum_slice_count=1, poll_interval=args.poll_interval,
                           on_elastic_event_callback=on_event)
    def train() -> None:
        run["attempt"] += 1
        entered = time.time()
        slices = sorted(manager.active_slice_indices)
        record: dict[str, Any] = {
            "attempt": run["attempt"], "slices": slices, "entered": entered,
            # From the previous attempt's end (or program start) until the manager found
            # enough healthy slices: its cleanup and health checks.
            "wait_s": entered - (run["event_at"] or started)}
        step = 0
        try:
            step = attempt(slices, record)
            record.update(end="done", ended=time.time(), last_step=step)
        except elastic_manager.ScaleUpSignalError:
            raise
        except Exception as error:
            step = record.get("last_step", step)
            record.update(end="error", ended=time.time(), last_step=step,
                          error=f"{type(error).__name__}: {str(error)[:400]}")
            log.write("error", attempt=run["attempt"], time=record["ended"],
                      error=record["error"])
            print(f"attempt {run['attempt']} failed after step {step} on slices {slices}: "
                  f"{str(error)[:200]}", flush=True)
            raise
        finally:
            run["attempts"].append(record)
            log.write("attempt", **record)

    def attempt(slices: list[int], record: dict[str, Any]) -> int:
        """One try on `slices`, from the latest snapshot; returns the last step done."""
        mesh = Mesh(np.array([manager.slice_to_devices[s] for s in slices]), ("slice", "data"))
        replicated = NamedSharding(mesh, P())
        batch_sharding = NamedSharding(mesh, P(("slice", "data")))

        def fresh_state():
            params = model.init(replicated)
            opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)
            return {"params": params, "opt_state": opt_state}

        began = time.time()
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
            jax.eval_shape(fresh_state))
        record["abstract_s"] = time.time() - began  # the model's shapes, traced afresh
        began = time.time()
        if snapshotter.latest is not None:
            snapshotter.join()  # a save still in flight becomes the latest first
            state = snapshotter.load({**abstract, "step": 0})
            step = state.pop("step")
            jax.block_until_ready(state)
            record.update(restore_s=time.time() - began, restored_step=step,
                          restored_bytes=sum(a.nbytes for a in jax.tree.leaves(state)))
        else:
            state, step = fresh_state(), 0
            snapshotter.save(0, {**state, "step": 0})
            record.update(init_s=time.time() - began, restored_step=None)
        record["last_step"] = step

        began = time.time()
        x_spec, y_spec = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=batch_sharding)
                          for a in model.batch(0, args.batch_size))
        lowered = jax.jit(update, out_shardings=(replicated, replicated)).lower(
            abstract, x_spec, y_spec)
        lowered_at = time.time()
        step_fn = lowered.compile()  # the server compiles it (or finds it compiled)
        record.update(lower_s=lowered_at - began, compile_s=time.time() - lowered_at)
        log.write("ready", **record)  # restored and compiled: the steps begin
        print(f"attempt {record['attempt']}: slices {slices}, mesh {dict(mesh.shape)}, "
              f"from step {step}", flush=True)

        while step < args.steps:
            if manager.available_inactive_slices:
                # Keep what this attempt did: the next one starts from here.
                snapshotter.join()
                snapshotter.save(step, {**state, "step": step})
                snapshotter.join()
                record.update(end="scale_up", ended=time.time(), last_step=step,
                              new_slices=sorted(manager.available_inactive_slices))
                print(f"slices {record['new_slices']} are up again: scaling up after step "
                      f"{step}", flush=True)
                raise elastic_manager.ScaleUpSignalError()
            step_began = time.time()
            x, y = model.batch(step + 1, args.batch_size)
            state, loss = step_fn(state, jax.device_put(x, batch_sharding),
                                  jax.device_put(y, batch_sharding))
            loss = float(loss)  # waits for the step: a lost slice surfaces here
            step += 1
            now = time.time()
            if "first_step_s" not in record:  # with loading the executable onto the workers
                record.update(first_step_s=now - step_began, first_step_done=now)
            record["last_step"] = step
            run["losses"][step] = loss
            run["executed"] += 1
            log.write("step", step=step, loss=loss, slices=slices, attempt=record["attempt"],
                      time=now, step_s=now - step_began)
            if step % args.print_every == 0 or step == args.steps:
                print(f"step {step:4d}  loss {loss:.6f}  slices {slices}  "
                      f"{now - step_began:.3f} s", flush=True)
            if step % args.snapshot_every == 0:
                snapshotter.save(step, {**state, "step": step})
            if args.step_delay:
                time.sleep(args.step_delay)
        snapshotter.join()
        return step

    try:
        train()
    finally:
        elapsed = time.time() - started
        losses = run["losses"]
        summary = {
            "steps": len(losses), "steps_run": run["executed"],
            "attempts": len(run["attempts"]), "wall_s": elapsed,
            "final_loss": losses.get(args.steps),
            "slices_per_attempt": [a["slices"] for a in run["attempts"]],
            "all_finite": all(math.isfinite(v) for v in losses.values())}
        log.write("summary", **summary)
        log.close()
    print(f"done: {summary['steps']} steps ({summary['steps_run']} run) in "
          f"{summary['attempts']} attempt(s) on slices {summary['slices_per_attempt']}, "
          f"final loss {summary['final_loss']}, {elapsed:.1f} s", flush=True)
    nan = float("nan")
    for a in run["attempts"]:
        print(f"  attempt {a['attempt']}: slices {a['slices']}  wait {a['wait_s']:.2f} s  "
              f"restore {a.get('restore_s', 0.0):.2f} s  compile {a.get('compile_s', nan):.2f} s"
              f"  first step {a.get('first_step_s', nan):.2f} s  ended: {a['end']} after "
              f"step {a['last_step']}", flush=True)
    return 0 if summary["steps"] == args.steps and summary["all_finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
