"""The shared service (issue 24): a queued job's start, a lease's grant, three tenants at once.

    python -m bench.shared [--quick] [--floods]

Starts a shared server (`--tenants`, a self-signed TLS port) on a local fleet of 3 slices x
1 host x 1 device and measures, as clients of the service do it (`isthmus.shared`):

- *handover*: one tenant holds all three slices; a second job waits in the queue for one.
  Its jax process is already started, with jax and isthmus imported (a job queued with
  `isthmus run --service` starts its command only once granted; the import is the job's own
  cost, not the service's). From the first lease's release: the queued lease's grant (its
  lease stream reports it), then, in the child, jax connected to the lease's tunnel and the
  first program's result (a program not compiled before: compile, run, fetch).
- *grant*: `shared.lease(...).__enter__()` on a free pool (a tunnel, TLS, the lease stream).
- *tenants*: a dispatch-bound loop (pipelined tiny jitted programs, timed in windows of at
  least 0.1 s) in one tenant's process alone, then in three tenants' processes at once, each
  on its own 1-slice lease through its own tunnel (`isthmus run --service -- python ...`, as
  users run a job: the lease and its forwarder live in that process); the ratio is
  per-program time alone / with three. For reference, the same loop on the same fleet without
  the shared mode (three clients, one slice's device each, no tunnel) and on local jax (three
  processes on the same cores: what the machine's CPU contention alone does), with the CPU
  each kind of process spends per program.

Then floods beside a tenant's loop (`bench/shared_floods.py`; `--floods`: only those). The
server and the client processes are `bench/shared_processes.py`'s. Prints a table; JSON to
bench/out/shared.json. `run(quick)` is the section of `python -m bench`. No figure here is a
test assertion.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

from bench.shared_processes import (
    Child,
    base_env,
    cpu_seconds,
    job_of,
    machine_busy_seconds,
    service,
)

FLEET = (3, 1, 1)  # slices, hosts per slice, devices per host
TENANTS = {"holder": 3, "queued": 1, "t1": 1, "t2": 1, "t3": 1}  # each one's max_slices
TARGETS = {"handover_ms": 1000.0, "grant_ms": 300.0, "ratio": 0.9}


# ---- the measurements ------------------------------------------------------------------------


def _lease(svc: dict[str, Any], who: str, slices: int = 1, report: Any = None) -> Any:
    from isthmus import shared

    return shared.lease(svc["service"], slices=slices, token_file=svc["tokens"][who],
                        ca=svc["ca"], report=report or (lambda line: None))


def _pool_free(svc: dict[str, Any], timeout: float = 30.0) -> None:
    """Waits until no slice is leased, then a moment more for the last one's scrub."""
    deadline = time.monotonic() + timeout
    while svc["server"].status()["shared"]["capacity_in_use"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"slices still leased after {timeout} s")
        time.sleep(0.05)
    time.sleep(0.2)


def handover(svc: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Slice freed -> the queued job's first program result (ms, medians; see the top)."""
    import numpy as np

    runs = []
    for repeat in range(repeats):
        _pool_free(svc)
        scale = 1.5 + repeat
        child = Child(["--queued", str(scale)], base_env())
        try:
            child.expect("READY")
            holder = _lease(svc, "holder", slices=3)
            holder.__enter__()
            try:
                waiting, granted, leave = threading.Event(), {}, threading.Event()

                def report(line: str, waiting: threading.Event = waiting) -> None:
                    if "in the queue" in line:
                        waiting.set()

                def queued(waiting: threading.Event = waiting, granted: dict[str, Any] = granted,
                           child: Child = child, leave: threading.Event = leave) -> None:
                    try:
                        with _lease(svc, "queued", report=report) as grant:
                            granted["at"] = time.monotonic()
                            child.send(grant.target)
                            leave.wait(120)
                    except BaseException as e:  # noqa: BLE001 - shown by the main thread
                        granted["error"] = e
                        waiting.set()

                thread = threading.Thread(target=queued, daemon=True)
                thread.start()
                if not waiting.wait(30) or "error" in granted:
                    raise RuntimeError(f"the second lease did not queue: "
                                       f"{granted.get('error')!r}")
                time.sleep(0.2)
            finally:
                released = time.monotonic()
                holder.__exit__(None, None, None)
            release_call = time.monotonic() - released
            stamps = json.loads(child.expect("{"))
            leave.set()
            thread.join(30)
            if "error" in granted:
                raise RuntimeError(f"the queued lease failed: {granted['error']!r}")
            expected = float((np.arange(8.0) * scale + 1).sum())
            if stamps["value"] != expected:
                raise RuntimeError(f"the queued job's result is {stamps['value']}, "
                                   f"not {expected}")
            runs.append({"release_to_grant_ms": (granted["at"] - released) * 1e3,
                         "grant_to_result_ms": (stamps["result"] - granted["at"]) * 1e3,
                         "connect_ms": (stamps["connected"] - stamps["got"]) * 1e3,
                         "first_program_ms": (stamps["result"] - stamps["connected"]) * 1e3,
                         "total_ms": (stamps["result"] - released) * 1e3,
                         "release_call_ms": release_call * 1e3})
        finally:
            child.close()
    return {**{key: statistics.median(run[key] for run in runs) for key in runs[0]},
            "repeats": repeats, "runs": runs}


def grant(svc: dict[str, Any], repeats: int) -> dict[str, Any]:
    """`shared.lease(...).__enter__()` on a free pool, and its `__exit__` (ms, medians)."""
    enter, leave = [], []
    for _ in range(repeats):
        _pool_free(svc)
        holding = _lease(svc, "t1")
        began = time.monotonic()
        holding.__enter__()
        enter.append(time.monotonic() - began)
        began = time.monotonic()
        holding.__exit__(None, None, None)
        leave.append(time.monotonic() - began)
    return {"grant_ms": statistics.median(enter) * 1e3,
            "release_ms": statistics.median(leave) * 1e3, "repeats": repeats,
            "grant_ms_all": [t * 1e3 for t in enter]}


def at_once(children: list[Child], rounds: int, seconds: float,
            servers: dict[str, list[int]]) -> dict[str, Any]:
    """Per-program time of one child alone (a different one each round) and of all at once:
    medians over rounds of the alone time and of the median and the worst over the children;
    the CPU per program of each kind of process (`servers`: role -> pids), and how many
    cores they kept busy with three."""
    roles = {"client": [c.pid for c in children],
             "tunnel": [c.process.pid for c in children if c.tunnelled], **servers}

    def go(group: list[Child]) -> tuple[list[float], dict[str, float], float, float]:
        """Per-program times; CPU µs per program by role; cores busy with these processes,
        and with any other (the machine is shared)."""
        start = time.monotonic() + 0.3
        for child in group:
            child.send(f"go {start} {seconds}")
        time.sleep(max(0.0, start - time.monotonic()))
        machine = machine_busy_seconds()
        before = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
        began = time.monotonic()
        answers = [json.loads(child.expect("{", 60 + seconds)) for child in group]
        wall = time.monotonic() - began
        used = {role: sum(map(cpu_seconds, pids)) - before[role]
                for role, pids in roles.items() if pids}
        machine = machine_busy_seconds() - machine
        programs = sum(a["programs"] for a in answers)
        ours = sum(used.values())
        return ([a["per_program_s"] for a in answers],
                {role: t / programs * 1e6 for role, t in used.items()},
                ours / wall, max(0.0, machine - ours) / wall)

    alone, together, worst, cpu_alone, cpu, cores, others = [], [], [], [], [], [], []
    for r in range(rounds):
        one, used, _, _ = go([children[r % len(children)]])
        alone.append(one[0])
        cpu_alone.append(used)
        each, used, busy, other = go(children)
        together.append(statistics.median(each))
        worst.append(max(each))
        cpu.append(used)
        cores.append(busy)
        others.append(other)
    return {"alone_us": statistics.median(alone) * 1e6,
            "three_us": statistics.median(together) * 1e6,
            "three_worst_us": statistics.median(worst) * 1e6,
            "ratio": statistics.median(a / t for a, t in zip(alone, together)),
            "ratio_worst": statistics.median(a / w for a, w in zip(alone, worst)),
            "aggregate_speedup": statistics.median(
                len(children) * a / t for a, t in zip(alone, together)),
            "cpu_us_per_program_alone": {role: statistics.median(c[role] for c in cpu_alone)
                                         for role in cpu[0]},
            "cpu_us_per_program_three": {role: statistics.median(c[role] for c in cpu)
                                         for role in cpu[0]},
            # CPU time of all these processes per second with three (of os.cpu_count())
            "cores_busy_three": statistics.median(cores),
            # and of every other process on the machine meanwhile (this bench's driver,
            # other users)
            "cores_other_three": statistics.median(others),
            "rounds": rounds, "seconds": seconds}


def loops(commands: list[tuple[dict[str, str], tuple[str, ...]]], rounds: int,
          seconds: float, servers: dict[str, list[int]]) -> dict[str, Any]:
    """Three loop processes (each: its environment, the command before it), at_once."""
    children = [Child(["--loop"], env, prefix) for env, prefix in commands]
    try:
        for child in children:
            child.pid = int(child.expect("READY", 180).split()[1])
        return at_once(children, rounds, seconds, servers)
    finally:
        for child in children:
            child.close()


def server_pids(server: Any) -> dict[str, list[int]]:
    fleet = server.status().get("fleet") or {}
    return {"controller": [server.process.pid],
            "workers": [w["pid"] for w in fleet.values() if w.get("pid")]}


def run(quick: bool = False) -> dict[str, Any]:
    """The three measurements; the loop also on the same fleet without the shared mode and
    on local jax (about 2 minutes on 2 cores; quick: about 1)."""
    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    began = time.monotonic()
    stages: dict[str, float] = {}

    def stage(name: str) -> None:
        stages[name] = time.monotonic() - began - sum(stages.values())

    rounds, seconds = (2, 1.5) if quick else (3, 3.0)
    tenants: dict[str, dict[str, Any]] = {}
    with service(FLEET, {name: f"max_slices = {slices}\n" for name, slices in TENANTS.items()},
                 "grace_seconds = 2\n") as svc:
        stage("server_start")
        results: dict[str, Any] = {"fleet": "x".join(map(str, FLEET)),
                                   "handover": handover(svc, 3 if quick else 5)}
        stage("handover")
        results["grant"] = grant(svc, 5 if quick else 10)
        stage("grant")
        # Each tenant's job as users start one (`isthmus run --service`), its loop's jax
        # pointed at the lease's tunnel.
        _pool_free(svc)
        tenants["isthmus shared"] = loops(
            [(base_env(), job_of(svc, who)) for who in ("t1", "t2", "t3")], rounds, seconds,
            server_pids(svc["server"]))
        stage("loop_shared")
    # The same fleet without --tenants: each client on its own slice's device, no tunnel.
    with LocalServer(devices=None, fleet=FLEET) as server:
        tenants["isthmus fleet, not shared"] = loops(
            [(child_environment(server.address, {**base_env(),
                                                 "ISTHMUS_BENCH_DEVICE": str(i)}), ())
             for i in range(3)], rounds, seconds, server_pids(server))
    stage("loop_fleet_not_shared")
    tenants["local jax"] = loops([({**base_env(), "JAX_PLATFORMS": "cpu"}, ())] * 3,
                                 rounds, seconds, {})
    stage("loop_local_jax")
    results["tenants"] = tenants
    results["seconds"] = {**stages, "all": time.monotonic() - began}
    return results


def report(results: dict[str, Any]) -> list[str]:
    """The section's lines in the table of `python -m bench`."""
    h, g, t = results["handover"], results["grant"], results["tenants"]
    lines = [
        f"shared service (fleet {results['fleet']} with --tenants, TLS tunnels; medians; "
        "targets in brackets):",
        f"  slice freed -> queued job's first program  {h['total_ms']:8.1f} ms  (<= "
        f"{TARGETS['handover_ms']:.0f}; {h['repeats']} repeats, jax already imported)",
        f"    release -> grant on the lease stream     {h['release_to_grant_ms']:8.1f} ms",
        f"    grant -> first program's result          {h['grant_to_result_ms']:8.1f} ms",
        f"      jax connected to the lease's tunnel    {h['connect_ms']:8.1f} ms",
        f"      first program: compile, run, fetch     {h['first_program_ms']:8.1f} ms",
        f"  lease granted on a free pool               {g['grant_ms']:8.1f} ms  (<= "
        f"{TARGETS['grant_ms']:.0f}; {g['repeats']} leases; release {g['release_ms']:.1f} ms)",
        f"  a loop of tiny jitted programs, 1 tenant alone vs 3 at once (alone/3 >= "
        f"{TARGETS['ratio']}; worst: the slowest of the 3;",
        "  aggr.: programs/s of all 3 over 1's; cores: CPU-seconds per second of all these",
        "  processes with 3, + of other processes on the machine meanwhile; CPU µs per",
        "  program by process, alone/with 3):",
        f"    {'':26}{'alone µs':>9}{'3 at once':>10}{'alone/3':>8}{'worst':>6}{'aggr.':>6}"
        f"{'cores':>11}   CPU per program",
    ]
    for name, row in t.items():
        cpu = ", ".join(f"{role} {row['cpu_us_per_program_alone'][role]:.0f}/{us:.0f}"
                        for role, us in row["cpu_us_per_program_three"].items())
        lines.append(f"    {name:26}{row['alone_us']:9.1f}{row['three_us']:10.1f}"
                     f"{row['ratio']:8.2f}{row['ratio_worst']:6.2f}"
                     f"{row['aggregate_speedup']:6.2f}{row['cores_busy_three']:6.2f} + "
                     f"{row['cores_other_three']:.2f}   {cpu}")
    return lines


def main() -> int:
    """`--floods`: only the floods beside a tenant (`bench/shared_floods.py`)."""
    from bench import shared_floods

    quick = "--quick" in sys.argv
    only_floods = "--floods" in sys.argv
    results = {} if only_floods else run(quick)
    results["floods"] = shared_floods.run(quick)
    print(f"{os.cpu_count()} cores; {'quick' if quick else 'full'} mode")
    print("\n".join([*([] if only_floods else report(results)),
                     *shared_floods.report(results["floods"])]))
    results.setdefault("seconds", {"all": results["floods"]["wall_s"]})
    out = pathlib.Path(__file__).parent / "out"
    out.mkdir(parents=True, exist_ok=True)
    written = out / ("shared_floods.json" if only_floods else "shared.json")
    written.write_text(json.dumps(results, indent=2))
    print(f"\nJSON: {written}   ({results['seconds']['all']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
