"""A learner and a sampler on two slices, driven at once by one Python program: plain jax.

    isthmus run --slices 2 --hosts-per-slice 1 --devices-per-host 4 -- \
        python examples/rl_loop.py

What one controller can do and multi-controller JAX cannot from one program: the learner
trains on slice 0 while the sampler, on slice 1, makes the next experience with the weights
of the round before; every round (K learner steps) the new weights are copied slice to slice
with a plain `jax.device_put`. Two threads dispatch the two loops; jax's calls return at
once, so each slice works while the other does.

The task is a toy contextual bandit made deterministic: the sampler proposes actions for
contexts (policy output plus exploration noise from a fixed key) and scores them against a
hidden target; the learner regresses the policy toward the best-scored proposals. The sampler
is always one round behind (it acts with the weights of the round before, as asynchronous RL
does), so a run's result does not depend on how the threads interleave: local jax and any
fleet print the same losses. Without two slices (local jax), the devices are split in two.

Prints one JSON line: the learner's loss per round, a checksum of the final weights, the
slice-to-slice weight copy (bytes, seconds) and the seconds of the rounds.
"""

import concurrent.futures
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROUNDS = int(os.environ.get("RL_ROUNDS", "6"))
STEPS = int(os.environ.get("RL_STEPS", "8"))  # learner steps per round (K)
BATCH, OBS, HIDDEN, ACT, PROPOSALS = 64, 16, int(os.environ.get("RL_HIDDEN", "128")), 4, 8


def two_slices(devices):
    """Slice 0 and slice 1 (or the two halves of one slice's devices)."""
    by_slice = {}
    for d in devices:
        by_slice.setdefault(getattr(d, "slice_index", 0), []).append(d)
    if len(by_slice) >= 2:
        first, second = sorted(by_slice)[:2]
        return by_slice[first], by_slice[second]
    half = len(devices) // 2
    return devices[:half], devices[half:]


def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (OBS, HIDDEN)) / OBS ** 0.5, "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, ACT)) / HIDDEN ** 0.5, "b2": jnp.zeros(ACT)}


def policy(params, obs):
    return jnp.tanh(obs @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


TARGET = np.random.default_rng(7).standard_normal((OBS, ACT)).astype(np.float32) / 4


@jax.jit
def sample(params, seed):
    """One batch of experience: contexts, and of PROPOSALS noisy actions the best scored."""
    k_obs, k_noise = jax.random.split(jax.random.fold_in(jax.random.key(1000), seed))
    obs = jax.random.normal(k_obs, (BATCH, OBS))
    noise = 0.3 * jax.random.normal(k_noise, (PROPOSALS, BATCH, ACT))
    proposals = policy(params, obs)[None] + noise
    reward = -jnp.sum((proposals - jnp.tanh(obs @ TARGET)[None]) ** 2, axis=-1)
    best = jnp.take_along_axis(proposals, jnp.argmax(reward, axis=0)[None, :, None], 0)[0]
    return obs, best


@jax.jit
def learn(params, obs, best):
    def loss(p):
        return jnp.mean((policy(p, obs) - best) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def main():
    learner_devices, sampler_devices = two_slices(jax.devices())
    learner = NamedSharding(Mesh(np.array(learner_devices), ("d",)), P())
    sampler = NamedSharding(Mesh(np.array(sampler_devices), ("d",)), P())
    params = jax.device_put(init(jax.random.key(0)), learner)
    acting = jax.device_put(params, sampler)  # the sampler's copy of the weights
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))

    def sample_round(weights, r):
        return jax.block_until_ready(
            [sample(weights, np.int32(r * STEPS + i)) for i in range(STEPS)])

    experience = sample_round(acting, 0)  # the first round's, before the loop
    losses, copies, rounds = [], [], []
    sampler_thread = concurrent.futures.ThreadPoolExecutor(1)
    for r in range(ROUNDS):
        start = time.perf_counter()
        # The sampler acts with the last round's weights while the learner trains.
        made = sampler_thread.submit(sample_round, acting, r + 1)
        values = []
        for obs, best in experience:
            params, value = learn(params, jax.device_put(obs, learner),
                                  jax.device_put(best, learner))
            values.append(value)
        losses.append(float(np.mean(jax.device_get(values))))
        experience = made.result()
        copy = time.perf_counter()
        acting = jax.block_until_ready(jax.device_put(params, sampler))  # slice to slice
        copies.append(time.perf_counter() - copy)
        rounds.append(time.perf_counter() - start)
    checksum = float(sum(np.abs(np.asarray(x)).sum() for x in jax.tree.leaves(params)))
    print(json.dumps({"losses": losses, "checksum": checksum, "weight_bytes": nbytes,
                      "copy_s": copies, "round_s": rounds,
                      "slices": [sorted({getattr(d, "slice_index", 0) for d in ds})
                                 for ds in (learner_devices, sampler_devices)]}))


if __name__ == "__main__":
    main()
