"""A worker's own cost per step, in process: what isthmus spends on a step beside jaxlib.

    python bench/worker_step.py [--platform cpu|tpu] [--sizes 32,16,16,10] [--steps N]

A worker's command applier (no controller, no sockets) on a host of one device applies, per
step, a decoded batch of an Execute of the MLP step of bench/tpu_work.py and a Free of the
parameters it replaced, as a worker reads them; the same steps through jaxlib's own call
(`execute_sharded(...).consume_with_handlers(...)`) give what jaxlib alone costs, and once
more with each argument's `is_deleted()` read first (what a worker's argument check cost
until 2026-12-07, which may differ by platform). Prints the calling thread's CPU
microseconds per step of each (median of 7 rounds) and the first two's difference,
isthmus's share. Like a worker, it collects and freezes what start-up made
(`gctune.settle`) and keeps jax's own backends on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import time
import types

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))


async def measure(platform: str, sizes: list[int], steps: int) -> dict[str, float]:
    import jax
    from tpu_work import mlp_init, mlp_update

    from isthmus.compat import jax as jax_compat
    from isthmus.ids import BufferId, ExecutableId
    from isthmus.transport import commands as c
    from isthmus.transport import messages as m
    from isthmus.transport.records import CompileRequest
    from isthmus.worker.agent import WorkerAgent
    from isthmus.worker.applying import CommandApplier
    from isthmus.worker.crashes import CrashRecord
    from isthmus.worker.host import DeviceHost
    from isthmus.worker.membership import Membership
    from isthmus.worker.platforms import make_client

    agent = WorkerAgent.__new__(WorkerAgent)  # no controller, links or process state
    agent.host = host = DeviceHost(make_client(platform, 1))
    agent.applier = CommandApplier(agent)
    agent._tasks, agent._waits = set(), {}
    agent.link = types.SimpleNamespace(send=lambda message: None)
    agent.membership = Membership()  # counts what it applies, as a welcomed worker's does
    crashes = CrashRecord.__new__(CrashRecord)  # no record file
    crashes._faulty, crashes.running = set(), lambda executable: None
    agent.crashes = crashes

    params = mlp_init(sizes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, sizes[0])).astype(np.float32)
    y = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], 128)]
    leaves = [np.asarray(v) for v in jax.tree_util.tree_leaves((params, x, y))]
    lowered = jax.jit(mlp_update).lower(params, x, y)
    options = jax_compat.xla_client().CompileOptions().SerializeAsString()
    program = ExecutableId(1)
    await host.compile(program, CompileRequest(lowered.as_text().encode(), options, (0,)))
    for index, value in enumerate(leaves):
        await host.put(BufferId(index), 0, value)
    n_params = len(leaves) - 2
    from isthmus import gctune

    gctune.settle()  # as a worker does once its first group is loaded (agent.py)
    args: list[int] = list(range(len(leaves)))
    next_base = 1000

    def batch() -> bytes:
        nonlocal next_base
        results = tuple(range(next_base, next_base + n_params + 1))
        message = m.Batch((c.Execute(program, tuple(args), results),
                           c.Free(tuple(BufferId(a) for a in args[:n_params]))))
        args[:n_params] = results[:n_params]
        next_base += 100
        encoded = m.encode(message)
        assert isinstance(encoded, bytes)
        return encoded

    async def through_worker(n: int) -> float:
        frames = [batch() for _ in range(n)]
        start = time.thread_time()
        for frame in frames:
            await agent._handle(m.decode(frame))
        cpu = time.thread_time() - start
        host.buffers.value(BufferId(next_base - 100 + n_params)).block_until_ready()
        return cpu / n * 1e6

    loaded = host._executables[program]

    def through_jaxlib(n: int, checked: bool = False) -> float:
        values = [host.buffers.value(BufferId(a)) for a in args]
        start = time.thread_time()
        for _ in range(n):
            if checked:  # what a worker did before 2026-12-07: each argument's state read
                for value in values:
                    value.is_deleted()
            outputs = loaded.executable.execute_sharded(values).consume_with_handlers(
                loaded.result_handlers)
            values[:n_params] = outputs[:n_params]
        cpu = time.thread_time() - start
        outputs[-1].block_until_ready()
        return cpu / n * 1e6

    await through_worker(200)
    through_jaxlib(200)
    worker, alone, checked = [], [], []
    for _ in range(7):
        worker.append(await through_worker(steps))
        alone.append(through_jaxlib(steps))
        checked.append(through_jaxlib(steps, checked=True))
    await host.close()
    return {"worker_us": statistics.median(worker), "jaxlib_us": statistics.median(alone),
            "checked_us": statistics.median(checked)}


def main() -> None:
    # As in a worker, jax's own backends stay on the CPU: the host's client is made by hand.
    # (With jax's default backend on the TPU too, this process held two TPU clients, whose
    # runtime threads made every figure on the chip larger: isthmus's share read 75 us.)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--sizes", default="32,16,16,10")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    result = asyncio.run(measure(args.platform, [int(s) for s in args.sizes.split(",")],
                                 args.steps))
    print(f"a worker's step, CPU us of the calling thread: {result['worker_us']:.1f}; "
          f"jaxlib's call alone {result['jaxlib_us']:.1f}; isthmus's share "
          f"{result['worker_us'] - result['jaxlib_us']:.1f}; jaxlib's call with each "
          f"argument's is_deleted() read first {result['checked_us']:.1f}")


if __name__ == "__main__":
    main()
