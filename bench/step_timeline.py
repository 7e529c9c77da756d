"""Where a training step's time goes: the MLP of bench/tpu_work.py (784-512-512-10, batch
128, SGD) pipelined, with the CPU time each process and thread spends per step.

    python bench/step_timeline.py [SECONDS]            # local jax, or
    isthmus run [...] -- python bench/step_timeline.py  # through isthmus

Prints one JSON object:

- `wall_us`: wall time per step, steps dispatched without waiting (as tpu_work.py's figure);
- `chip_us`: the device's time per step, from 50 steps in one program (`lax.scan`: no
  dispatch between them), so what a step costs the chip alone;
- `one_step_us`: one step dispatched and waited for (p50): dispatch, the wire, the server,
  the chip and the answer, with nothing overlapped;
- `cpu_us`: CPU time per pipelined step of each process in the run and of its busiest
  threads, read from /proc: `client` (this process; its main thread is the stock client's
  dispatch), and through isthmus `server` (the process of `isthmus run`/`isthmus up`: the
  front end, the controller and, on the embedded backend, the device host) and each
  `worker` process. A thread near `wall_us` is what the pipeline waits for.

The server is this process's parent (`isthmus run`), or ISTHMUS_BENCH_SERVER_PID; its
workers are its child processes. Linux only (reads /proc).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np


def _ticks(path: str) -> float:
    """CPU seconds (user + system) of a /proc stat file; 0 where it is gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                found.append(int(entry))
    return found


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return False
    return b"worker" in words or b"isthmus.worker" in words


def processes() -> dict[str, int]:
    """The processes of the run, by role: this client, and through isthmus its server and
    the server's workers (child processes other than this one)."""
    roles = {"client": os.getpid()}
    if os.environ.get("JAX_PLATFORMS") != "proxy":
        return roles
    server = int(os.environ.get("ISTHMUS_BENCH_SERVER_PID") or os.getppid())
    roles["server"] = server
    workers = [p for p in _children(server) if p != os.getpid() and _is_worker(p)]
    for i, pid in enumerate(sorted(workers)):
        roles[f"worker{i}" if len(workers) > 1 else "worker"] = pid
    return roles


def _threads(pid: int) -> dict[int, float]:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    return {int(t): _ticks(f"/proc/{pid}/task/{t}/stat") for t in tids}


def _name(pid: int, tid: int) -> str:
    if tid == pid:
        return "main"
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(tid)


def cpu_per_step(roles: dict[str, int], before: dict[str, dict[int, float]],
                 steps: int) -> dict[str, dict[str, float]]:
    """Microseconds of CPU per step of each process (`total`) and of its threads that used
    at least 5% of it (by name; threads of one name summed)."""
    out = {}
    for role, pid in roles.items():
        after = _threads(pid)
        used = {tid: after[tid] - before[role].get(tid, 0.0) for tid in after}
        total = sum(used.values())
        row = {"total": total / steps * 1e6}
        for tid, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
            if seconds >= 0.05 * total and seconds > 0:
                name = _name(pid, tid)
                row[name] = row.get(name, 0.0) + seconds / steps * 1e6
        out[role] = row
    return out


def main() -> None:
    import pathlib

    import jax

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from tpu_work import mlp_init
    from tpu_work import mlp_update as update

    step = jax.jit(update)

    @jax.jit
    def fifty(params, x, y):  # the chip's time per step, with no dispatch between steps
        return jax.lax.scan(lambda p, _: update(p, x, y), params, None, length=50)

    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((128, 784)).astype(np.float32))
    y = jax.device_put(np.eye(10, dtype=np.float32)[rng.integers(0, 10, 128)])
    params = mlp_init([784, 512, 512, 10])
    for _ in range(20):
        params, value = step(params, x, y)
    jax.block_until_ready(fifty(params, x, y))
    chips = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fifty(params, x, y))
        chips.append((time.perf_counter() - start) / 50)
    one = []
    for _ in range(50):
        start = time.perf_counter()
        params, value = step(params, x, y)
        jax.block_until_ready(value)
        one.append(time.perf_counter() - start)

    roles = processes()
    before = {role: _threads(pid) for role, pid in roles.items()}
    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        values = []  # the losses of the last 50 steps kept, as a loop that logs them
        for _ in range(50):  # never waiting, as tpu_work.py's figure
            params, value = step(params, x, y)
            values.append(value)
        steps += 50
    jax.block_until_ready(values)  # each step reads the last: all have run
    wall = time.perf_counter() - start
    out = {"platform": jax.devices()[0].platform, "steps": steps,
           "wall_us": wall / steps * 1e6,
           "chip_us": statistics.median(chips) * 1e6,
           "one_step_us": statistics.median(one) * 1e6,
           "cpu_us": cpu_per_step(roles, before, steps)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
