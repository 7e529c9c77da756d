"""windows.py's loop with no server: the step run by a `DeviceHost` in this process, as the
embedded backend's server runs it (its arguments read from the host's store, its outputs
stored, the replaced one freed), with no front end, controller or socket.

    python bench/phases/host_windows.py SIZES SECONDS [--platform cpu|tpu]

Prints one JSON line per size, as windows.py does. On the TPU the embedded server stops once
for ~200 ms about a second after a program starts running (bench/RESULTS.md, issue 49's
eighth round) and local jax does not: a stop here puts it in the host's way of running a
program; none, in the server around it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent.parent))

WINDOW = 10


async def windows(host, n: int, seconds: float, program: int) -> tuple[float, list]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from isthmus.compat import jax as jax_compat
    from isthmus.ids import BufferId, ExecutableId
    from isthmus.transport.records import CompileRequest

    def step(x, w):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    ones = np.ones((n, n), np.float32)
    lowered = jax.jit(step).lower(ones, ones)
    options = jax_compat.xla_client().CompileOptions().SerializeAsString()
    executable = ExecutableId(program)
    await host.compile(executable, CompileRequest(lowered.as_text().encode(), options, (0,)))
    weights = BufferId(2)
    await host.put(BufferId(1), 0, ones)
    await host.put(weights, 0, np.eye(n, dtype=np.float32) * 0.5 + 0.01)
    current, next_id = 1, 1000

    def run() -> int:
        nonlocal current, next_id
        out = next_id
        next_id += 100
        host.execute(executable, [current, weights], [out])
        host.free([BufferId(current)])
        current = out
        return out

    for _ in range(3):
        run()
    # The window before's last output, held here: the store frees it once the next step
    # has taken it, and the wait must still find it.
    behind = host.buffers.value(BufferId(current))
    behind.block_until_ready()
    times, steps = [], 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        began = time.time()
        for _ in range(WINDOW):
            last = run()
        newest = host.buffers.value(BufferId(last))
        dispatched = time.time()
        behind.block_until_ready()
        times.append((began, dispatched, time.time()))
        behind, steps = newest, steps + WINDOW
        await asyncio.sleep(0)
    host.buffers.value(BufferId(current)).block_until_ready()
    return (time.perf_counter() - start) / steps * 1e3, times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--platform", default="cpu")
    args = parser.parse_args()
    from isthmus.worker.host import DeviceHost
    from isthmus.worker.platforms import make_client

    host = DeviceHost(make_client(args.platform, 1))
    for program, size in enumerate(int(s) for s in args.sizes.split(",")):
        ms, times = await windows(host, size, args.seconds, program + 1)
        print(json.dumps({"n": size, "ms": ms, "windows": times}), flush=True)
    await host.close()


if __name__ == "__main__":
    asyncio.run(main())
