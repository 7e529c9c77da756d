"""Tunix GRPO (google-tunix 0.1.7), unmodified: a few training steps of Tunix's
`GRPOLearner` on Tunix's own toy transformer and mock vocabulary (`tunix.tests.test_common`,
shipped in the wheel), set up the way Tunix's `tests/rl/grpo/grpo_learner_test.py` does, with
no downloads.

With 8 devices the trainer (actor and reference) runs on a mesh over devices 0..3 and the
vanilla rollout engine on a second mesh over devices 4..7 (`ClusterConfig.role_to_mesh`), so
each step moves the rollout's batch to the trainer and, after the update, the actor's weights
to the rollout. On two slices of 4 devices that is one slice each. With fewer than 8 devices
both roles share one mesh over all of them.

Deterministic: the models are built from fixed `nnx.Rngs`, the dataset is fixed and not
shuffled, and the rollout samples with a fixed key. Prints `WORKLOAD {"name", "value"}` lines:
per step the actor's loss and KL and the rewards, then a checksum of the trained parameters.

Environment: TUNIX_GRPO_STEPS (default 4) training steps.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
import optax
from flax import nnx
from grain import python as grain
from jax.sharding import Mesh
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

STEPS = int(os.environ.get("TUNIX_GRPO_STEPS", "4"))
T0 = time.perf_counter()


def emit(name: str, value) -> None:
    print("WORKLOAD " + json.dumps({"name": name, "value": value}), flush=True)


# Prompts in MockVocab's words (tunix.tests.test_common.MockVocab): other words are dropped
# by its EncodeAsIds.
PROMPTS = [
    "input string",
    "hello world",
    "My name",
    "hello there",
    "Tunix library",
    "distributed training",
    "My name is",
    "Hello there !",
]


def overlap_reward(prompts, completions, **kwargs):
    """Fraction of the completion's words that are in the prompt, plus a bonus per 'Tunix'."""
    del kwargs
    out = []
    for prompt, completion in zip(prompts, completions):
        words = completion.split()
        if not words:
            out.append(0.0)
            continue
        seen = set(prompt.split())
        out.append(sum(w in seen for w in words) / len(words) + 0.5 * words.count("Tunix"))
    return out


def length_reward(completions, **kwargs):
    """Shorter completions (an early '</s>') score higher."""
    del kwargs
    return [1.0 - len(c.split()) / 10.0 for c in completions]


class Source(grain.RandomAccessDataSource):
    def __init__(self, data):
        self._data = list(data)

    def __getitem__(self, idx):
        return self._data[idx]

    def __len__(self):
        return len(self._data)


def dataset(batch_size: int):
    return (grain.MapDataset.source(Source(PROMPTS))
            .batch(batch_size)
            .map(lambda x: {"prompts": x, "answer": x}))


def meshes() -> tuple[Mesh, Mesh]:
    devices = jax.devices()
    if len(devices) >= 8:
        train = Mesh(np.array(devices[0:4]).reshape(2, 2), ("fsdp", "tp"))
        rollout = Mesh(np.array(devices[4:8]).reshape(2, 2), ("fsdp", "tp"))
        return train, rollout
    n = len(devices)
    tp = 2 if n % 2 == 0 and n > 1 else 1
    mesh = Mesh(np.array(devices).reshape(n // tp, tp), ("fsdp", "tp"))
    return mesh, mesh


def main() -> None:
    emit("device_count", jax.device_count())
    train_mesh, rollout_mesh = meshes()
    vocab = tc.MockVocab()
    config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
    actor = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
    reference = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
    initial = float(sum(np.sum(np.asarray(jax.device_get(x), np.float64))
                        for x in jax.tree.leaves(nnx.state(actor, nnx.Param))))
    emit("param_sum_initial", initial)

    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: train_mesh,
            rl_cluster_lib.Role.REFERENCE: train_mesh,
            rl_cluster_lib.Role.ROLLOUT: rollout_mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(1e-2),
            eval_every_n_steps=1000,
            max_steps=STEPS,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=8,
            max_prompt_length=8,
            kv_cache_size=32,
            temperature=0.9,
            top_p=1.0,
            seed=jax.random.PRNGKey(42),
        ),
    )
    rl_cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=vocab, cluster_config=cluster_config)
    learner = grpo_lib.GRPOLearner(
        rl_cluster=rl_cluster,
        reward_fns=[overlap_reward, length_reward],
        algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04),
    )
    emit("separate_rollout_mesh", train_mesh != rollout_mesh)
    learner.train(dataset(batch_size=2))
    jax.effects_barrier()

    steps = learner.rl_cluster.actor_trainer.train_steps
    emit("train_steps", int(steps))
    trainer_log = learner.rl_cluster.actor_trainer.metrics_logger
    for name in ("loss", "kl"):
        emit(f"actor/{name}", [float(v) for v in
                               trainer_log.get_metric_history("actor", name, "train")])
    rl_log = learner.rl_cluster._rl_metrics_logger
    for name in ("sum", "overlap_reward", "length_reward"):
        try:
            history = rl_log.get_metric_history("rewards", name, "train")
        except ValueError:
            continue
        emit(f"rewards/{name}", [float(v) for v in history])

    trained = nnx.state(learner.rl_cluster.actor_trainer.model, nnx.Param)
    leaves = [np.asarray(jax.device_get(x), np.float64) for x in jax.tree.leaves(trained)]
    emit("param_sum", float(sum(np.sum(x) for x in leaves)))
    emit("param_abs_sum", float(sum(np.sum(np.abs(x)) for x in leaves)))
    rollout_state = nnx.state(learner.rl_cluster.rollout.model(), nnx.Param)
    emit("rollout_param_sum", float(sum(np.sum(np.asarray(jax.device_get(x), np.float64))
                                        for x in jax.tree.leaves(rollout_state))))
    print(f"wall {time.perf_counter() - T0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
