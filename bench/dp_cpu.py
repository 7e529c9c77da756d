"""Where the data-parallel loop's CPU goes (issue 27): CPU milliseconds per step of every
process of the default fleet (controller, each worker, the client) and of the
multi-controller twin (its processes together), on this machine, in one run.

    python -m bench.dp_cpu [ROUNDS]

Each figure is the difference between a run of 3 * STEPS and one of STEPS steps of
bench/dp_loop.py over the 2 * STEPS steps between them (so start-up, compilation and the
timed pieces cancel out), median over ROUNDS (default 2) rounds. Linux only (/proc).
On a machine with fewer cores than the loop's busy threads (this one: 2), what the fleet
spends beside the workers (controller and client) is taken from the workers' collectives,
which is what separates the two in steps per second.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from bench.__main__ import HERE, _base, _through
from bench.client_metrics import cpu_seconds
from bench.peer import run_peer
from isthmus.testing import LocalServer

STEPS = 300


def _children() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _fleet_once(env: dict[str, str], pids: dict[str, int], steps: int) -> dict[str, float]:
    before = {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    children = _children()
    result = subprocess.run([sys.executable, str(HERE / "dp_loop.py"), str(steps)], env=env,
                            capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise RuntimeError(f"dp_loop.py failed:\n{result.stderr[-4000:]}")
    spent = {name: (cpu_seconds(pid) or 0.0) - before[name] for name, pid in pids.items()}
    spent["client"] = _children() - children
    spent["steps_per_s"] = json.loads(result.stdout.strip().splitlines()[-1])["steps_per_s"]
    return spent


def _twin_once(steps: int) -> dict[str, float]:
    children = _children()
    out = run_peer("dp_loop.py", 2, 4, [str(steps)], base=_base())
    return {"twin processes": _children() - children, "steps_per_s": out["steps_per_s"]}


def _per_step(short: dict[str, float], long: dict[str, float]) -> dict[str, float]:
    return {k: (long[k] - short[k]) / (2 * STEPS) * 1e3 for k in short if k != "steps_per_s"}


def measure(rounds: int) -> dict[str, dict[str, float]]:
    fleet: list[dict[str, float]] = []
    twin: list[dict[str, float]] = []
    rates: dict[str, list[float]] = {"fleet": [], "twin": []}
    with LocalServer(devices=None, fleet=(1, 2, 4)) as server:
        env = _through(server)
        pids = {"controller": int(env["ISTHMUS_BENCH_SERVER_PID"])}
        for index, pid in enumerate(env["ISTHMUS_BENCH_WORKER_PIDS"].split(",")):
            pids[f"worker {index}"] = int(pid)
        for _ in range(rounds):
            short, long = _fleet_once(env, pids, STEPS), _fleet_once(env, pids, 3 * STEPS)
            fleet.append(_per_step(short, long))
            rates["fleet"] += [short["steps_per_s"], long["steps_per_s"]]
            short, long = _twin_once(STEPS), _twin_once(3 * STEPS)
            twin.append(_per_step(short, long))
            rates["twin"] += [short["steps_per_s"], long["steps_per_s"]]
    table = {}
    for name, runs in (("isthmus fleet 1x2x4", fleet), ("multi-controller 2x4", twin)):
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["all"] = sum(row.values())
        table[name] = row
    table["steps/s"] = {k: statistics.median(v) for k, v in rates.items()}
    return table


def report(table: dict[str, dict[str, float]]) -> str:
    lines = ["CPU ms per step of bench/dp_loop.py (medians; bench/dp_cpu.py):"]
    for name in ("isthmus fleet 1x2x4", "multi-controller 2x4"):
        row = table[name]
        lines.append(f"  {name:22}" + "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
    rates = table["steps/s"]
    lines.append(f"  steps/s in these runs: fleet {rates['fleet']:.1f}, twin {rates['twin']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    start = time.monotonic()
    result = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print(report(result))
    print(f"({time.monotonic() - start:.0f} s)")
