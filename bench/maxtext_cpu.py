"""Where a MaxText step's CPU goes (issue 40): CPU milliseconds per step of every process of
the default fleet (controller, each worker by thread, the client) and of multi-controller
MaxText (its processes together), on this machine, in one run.

    python -m bench.maxtext_cpu [ROUNDS]   (in the workloads environment, .venv-new)

Each figure is the difference between a run of LONG and one of SHORT steps of
bench/maxtext_step.py over the LONG - SHORT steps between them (start-up, compilation and
warm-up cancel out), median over ROUNDS (default 2) rounds. A worker's threads are summed by
name (/proc/PID/task/*/comm), which tells XLA's device threads from gloo's and the Python
loop's. Linux only (/proc). No figure is a test assertion.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time

from bench.client_metrics import cpu_seconds
from bench.maxtext_peer import SHARED_ENV, _base, _step, _summary
from bench.peer import run_peer
from isthmus.serve import child_environment
from isthmus.testing import LocalServer

SHORT, LONG = 15, 45


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    spent: dict[str, float] = collections.defaultdict(float)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")].rstrip("0123456789-_") or "?"
        fields = stat.rsplit(")", 1)[1].split()
        spent[name] += (int(fields[11]) + int(fields[12])) / tick
    return spent


def _children() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _fleet_once(env: dict[str, str], pids: dict[str, int], steps: int) -> dict[str, float]:
    before = {name: _threads(pid) for name, pid in pids.items()}
    controller = cpu_seconds(pids["controller"]) or 0.0
    children = _children()
    run = _step(env, steps)
    spent = {"client": _children() - children,
             "controller": (cpu_seconds(pids["controller"]) or 0.0) - controller}
    for name, pid in pids.items():
        if name == "controller":
            continue
        for thread, seconds in _threads(pid).items():
            spent[f"{name}: {thread}"] = seconds - before[name].get(thread, 0.0)
    spent["step_ms"] = _summary(run)["step_ms"]
    return spent


def _peer_once(steps: int) -> dict[str, float]:
    children = _children()
    run = run_peer("maxtext_step.py", 2, 4, [str(steps)], base=_base())
    return {"peer processes": _children() - children, "step_ms": _summary(run)["step_ms"]}


def _per_step(short: dict[str, float], long: dict[str, float]) -> dict[str, float]:
    return {k: (long.get(k, 0.0) - short.get(k, 0.0)) / (LONG - SHORT) * 1e3
            for k in long if k != "step_ms"}


def measure(rounds: int) -> dict[str, dict[str, float]]:
    fleet: list[dict[str, float]] = []
    peer: list[dict[str, float]] = []
    steps: dict[str, list[float]] = {"fleet": [], "peer": []}
    with LocalServer(devices=None, fleet=(1, 2, 4)) as server:
        assert server.process is not None
        env = child_environment(server.address, _base())
        env[SHARED_ENV[0]] = server.status()["shared_dir"]
        env[SHARED_ENV[1]] = str(1 << 20)
        pids = {"controller": server.process.pid}
        workers = (server.status().get("fleet") or {}).values()
        for index, worker in enumerate(w for w in workers if w.get("pid")):
            pids[f"worker {index}"] = int(worker["pid"])
        for _ in range(rounds):
            short, long = _fleet_once(env, pids, SHORT), _fleet_once(env, pids, LONG)
            fleet.append(_per_step(short, long))
            steps["fleet"] += [short["step_ms"], long["step_ms"]]
            short, long = _peer_once(SHORT), _peer_once(LONG)
            peer.append(_per_step(short, long))
            steps["peer"] += [short["step_ms"], long["step_ms"]]
    table = {}
    for name, runs in (("isthmus fleet 1x2x4", fleet), ("multi-controller 2x4", peer)):
        keys = sorted({k for r in runs for k in r})
        row = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}
        row["all"] = sum(row.values())
        table[name] = row
    table["step ms"] = {k: statistics.median(v) for k, v in steps.items()}
    return table


def report(table: dict[str, dict[str, float]]) -> str:
    lines = [f"CPU ms per MaxText step (steps {SHORT}-{LONG}, medians; bench/maxtext_cpu.py):"]
    for name in ("isthmus fleet 1x2x4", "multi-controller 2x4"):
        lines.append(f"  {name}:")
        for key, value in table[name].items():
            if abs(value) >= 0.05:
                lines.append(f"    {key:40} {value:8.2f}")
    rates = table["step ms"]
    lines.append(f"  step ms in these runs: fleet {rates['fleet']:.1f}, peer {rates['peer']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    start = time.monotonic()
    print(report(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 2)))
    print(f"({time.monotonic() - start:.0f} s)")
