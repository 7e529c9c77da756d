"""python -m bench [--quick]: isthmus beside local jax, in one run.

MaxText's section runs in the workloads environment (bench/maxtext_peer.py finds it).

Starts its own servers (an embedded one and a local fleet of 2 slices x 2 hosts), runs the
same client programs through them and on local jax, and prints one table; JSON and a PNG of
the dispatch-threshold curve go to bench/out/. The shared service's section (a queued job's
start, a lease's grant, three tenants at once) is bench/shared.py, on a fleet of its own.
No figure here is a test assertion.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from isthmus.serve import child_environment
from isthmus.testing import LocalServer
from isthmus.worker.scheduling import ENVIRONMENT

HERE = pathlib.Path(__file__).parent
OUT = HERE / "out"
SHARED_ENV = ("IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY",
              "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES")


STAGES: list[tuple[str, float]] = []  # (what, seconds), shown at the end


def _run(script: str, env: dict[str, str], args: list[str]) -> dict:
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(HERE / script), *args], env=env,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"{script} failed:\n{result.stderr[-4000:]}")
    STAGES.append((f"{script} {' '.join(args)}", time.monotonic() - start))
    return json.loads(result.stdout.strip().splitlines()[-1])


def _base() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET", *SHARED_ENV)}


def _local(devices: int = 1) -> dict[str, str]:
    env = {**_base(), "JAX_PLATFORMS": "cpu"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _through(server: LocalServer, shared: bool = False) -> dict[str, str]:
    env = child_environment(server.address, _base())
    env["ISTHMUS_BENCH_SERVER_PID"] = str(server.process.pid)  # type: ignore[union-attr]
    fleet = server.status().get("fleet") or {}
    env["ISTHMUS_BENCH_WORKER_PIDS"] = ",".join(str(w["pid"]) for w in fleet.values()
                                                if w.get("pid"))
    if shared:
        env[SHARED_ENV[0]] = server.status()["shared_dir"]
        env[SHARED_ENV[1]] = str(1 << 20)
    return env


def paired_curves(local: Callable[[], dict], mine: Callable[[], dict], rounds: int
                  ) -> tuple[dict, list[float]]:
    """Runs the local and the isthmus curve in turn, `rounds` times; returns the median
    local curve and, per size, the median of isthmus/local within a round (so slow drifts
    of a shared machine fall on both sides of each ratio)."""
    ratios: list[list[float]] = []
    locals_: list[dict] = []
    for _ in range(rounds):
        theirs, ours = local(), mine()
        locals_.append(theirs)
        ratios.append([m / t for m, t in zip(ours["steps_per_s"], theirs["steps_per_s"])])
    reference = {"sizes": locals_[0]["sizes"],
                 "step_ms": [statistics.median(c["step_ms"][i] for c in locals_)
                             for i in range(len(locals_[0]["sizes"]))]}
    return reference, [statistics.median(r[i] for r in ratios) for i in range(len(ratios[0]))]


# The simulated accelerator's rate per device (FLOP/s), and the sizes that give steps of
# about 0.02 to 9 ms on it (4 chained n x n matmuls: 8 n^3 FLOPs per step and device).
SIMULATED_FLOPS = 1e12
SIMULATED_SIZES = "128,256,320,400,512,640,800,1024"


def simulated_curve(server: LocalServer, sizes: str, seconds: str, devices: int,
                    rate: float, rounds: int) -> tuple[dict, list[float]]:
    """The threshold curve on simulated accelerators (`--simulate-flops rate`): the
    reference is the device time itself, a step every FLOPs/rate seconds, which is what
    local jax on such a device would reach at best; so the ratio measures dispatch alone."""
    runs = [_run("threshold.py", _through(server), [sizes, "4", seconds, str(devices)])
            for _ in range(rounds)]
    step_ms = [4 * 2 * n ** 3 / devices / rate * 1e3 for n in runs[0]["sizes"]]
    ratios = [statistics.median(ideal / run["step_ms"][i] for run in runs)
              for i, ideal in enumerate(step_ms)]
    return {"sizes": runs[0]["sizes"], "step_ms": step_ms}, ratios


def threshold(step_ms: list[float], ratios: list[float], level: float = 0.95) -> float | None:
    """The smallest step (local ms) from which on isthmus keeps at least `level` of local
    jax's throughput at every larger measured step; None when it never does."""
    found = None
    for ms, ratio in zip(reversed(step_ms), reversed(ratios)):
        if ratio < level:
            break
        found = ms
    return found


def plot(curves: dict[str, tuple[list[float], list[float]]], path: pathlib.Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: pip install -e '.[bench]' for the PNG)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (step_ms, ratios) in curves.items():
        ax.plot(step_ms, ratios, marker="o", label=name)
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=1, label="95% of local jax")
    ax.set_xscale("log")
    ax.set_xlabel("compute per step on local jax, or device time when simulated (ms)")
    ax.set_ylabel("isthmus throughput / local throughput")
    ax.set_ylim(0, 1.2)
    ax.set_title("Dispatch threshold: pipelined jitted steps of growing size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


DP_PIECES = ("steps_per_s", "put_ms", "elementwise_ms", "sum_ms", "sum_fetch_ms")


def dp_against_peer(steps: int, rounds: int, normal_gloo: bool = False) -> dict[str, dict]:
    """The data-parallel loop on local jax (8 devices in one process), on its
    multi-controller twin (2 processes x 4 devices, gloo) and on the default fleet (1 slice
    x 2 hosts x 4 devices, one client), fed from the client and by a colocated loader on the
    workers, in `rounds` paired rounds; each figure is a median, and `/ peer` the median of
    each round's ratio of steps/s to the twin's. With `normal_gloo`, also client-fed on a
    second fleet whose gloo thread keeps the OS's default scheduling (worker/scheduling.py)."""
    from bench.peer import run_peer

    fleet, loader = "isthmus fleet 1x2x4", "fleet, colocated loader"
    normal = "fleet, gloo normal"
    runs: dict[str, list[dict]] = {"local jax 8 devices": [], "multi-controller 2x4": [],
                                   fleet: [], loader: []}
    if normal_gloo:
        runs[normal] = []
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LocalServer(devices=None, fleet=(1, 2, 4)))
        other = stack.enter_context(LocalServer(
            devices=None, fleet=(1, 2, 4), env={**os.environ, ENVIRONMENT: "normal"})
        ) if normal_gloo else None
        for _ in range(rounds):
            if other is not None:
                runs[normal].append(_run("dp_loop.py", _through(other), [str(steps)]))
            runs["local jax 8 devices"].append(_run("dp_loop.py", _local(8), [str(steps)]))
            runs["multi-controller 2x4"].append(run_peer("dp_loop.py", 2, 4, [str(steps)],
                                                         base=_base()))
            runs[fleet].append(_run("dp_loop.py", _through(server), [str(steps)]))
            # The single-controller way to feed it: batches made on the workers.
            runs[loader].append(_run("dp_loop.py", {**_through(server),
                                                    "ISTHMUS_BENCH_FEED": "colocated"},
                                     [str(steps)]))
    STAGES.append(("dp_loop.py, its peer and the fleet", time.monotonic() - began))
    table = {name: {key: statistics.median(r[key] for r in rs) for key in DP_PIECES}
             for name, rs in runs.items()}
    for name in runs.keys() - {"local jax 8 devices", "multi-controller 2x4"}:
        table[name]["/ peer"] = statistics.median(
            f["steps_per_s"] / p["steps_per_s"]
            for f, p in zip(runs[name], runs["multi-controller 2x4"]))
    return table


# Issue 27's targets for the loop and the two slices, printed beside the figures.
DP_TARGETS = {"put_ms": 1.0, "sum_fetch_over_twin_ms": 0.5, "ratio": 1.0, "overlap": 1.3,
              "weight_copy_GBps": 1.0}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def dp_targets(table: dict[str, dict]) -> list[str]:
    """The loop's figures against `DP_TARGETS`, a line each."""
    fleet, loader = table["isthmus fleet 1x2x4"], table["fleet, colocated loader"]
    twin = table["multi-controller 2x4"]
    over = fleet["sum_fetch_ms"] - twin["sum_fetch_ms"]
    return [
        f"  targets: sharded put {fleet['put_ms']:.2f} ms <= {DP_TARGETS['put_ms']:.0f}: "
        f"{_met(fleet['put_ms'] <= DP_TARGETS['put_ms'])}; sum + fetch {over:+.2f} ms over "
        f"the twin's, <= {DP_TARGETS['sum_fetch_over_twin_ms']}: "
        f"{_met(over <= DP_TARGETS['sum_fetch_over_twin_ms'])}",
        f"           client-fed {fleet['/ peer']:.2f}x >= {DP_TARGETS['ratio']:.1f}: "
        f"{_met(fleet['/ peer'] >= DP_TARGETS['ratio'])}; colocated loader "
        f"{loader['/ peer']:.2f}x: {_met(loader['/ peer'] >= DP_TARGETS['ratio'])}"]


def slices_targets(slices: dict[str, dict]) -> list[str]:
    """The two-slice figures of the fleets against `DP_TARGETS`, a line each."""
    lines = []
    for name, row in slices.items():
        if name.startswith("local"):
            continue
        lines.append(
            f"  {name}: weight copy {row['weight_copy_GBps']:.2f} GB/s >= "
            f"{DP_TARGETS['weight_copy_GBps']:.0f}: "
            f"{_met(row['weight_copy_GBps'] >= DP_TARGETS['weight_copy_GBps'])}; overlap "
            f"{row['overlap']:.2f}x >= {DP_TARGETS['overlap']}: "
            f"{_met(row['overlap'] >= DP_TARGETS['overlap'])}")
    return lines


def dp_report(table: dict[str, dict]) -> str:
    lines = ["\ndata-parallel loop (bench/dp_loop.py: MLP + adam, a fresh batch put every "
             "step, loss read\nevery 10) against its peer, multi-controller JAX on the same "
             "processes and devices:"]
    lines.append(f"{'':24}" + "".join(f"{k:>15}" for k in DP_PIECES))
    for name, row in table.items():
        lines.append(f"{name:24}" + "".join(f"{row[k]:15.2f}" for k in DP_PIECES))
    for name, row in table.items():
        if "/ peer" in row:
            lines.append(f"  {name} / multi-controller, steps/s: {row['/ peer']:.2f}x")
    return "\n".join(lines + dp_targets(table))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="finish in a few minutes")
    args = parser.parse_args()
    quick = args.quick
    start = time.monotonic()
    OUT.mkdir(parents=True, exist_ok=True)
    metrics_args = ["--quick"] if quick else []
    sizes = ("64,128,192,256,384,640" if quick else
             "16,32,64,96,128,192,256,320,384,448,512,640,768")
    seconds = "0.3" if quick else "1.5"
    rounds = 3
    results: dict[str, dict] = {"machine": {
        "machine": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
        "quick": quick}}

    metrics = {"local jax": _run("client_metrics.py", _local(), metrics_args)}
    # Colocated Python rows (bench/colocated.py): a 1 MiB call's round trip, and a training
    # loop fed by a colocated loader against the same loop fed from the client.
    colocated_args = ["--client", *metrics_args]
    metrics["local jax"].update(_run("colocated.py", _local(), colocated_args))
    curves: dict[str, tuple[dict, list[float]]] = {}  # backend -> (local curve, ratios)
    compile_times = {}
    with LocalServer(devices=1) as server:
        metrics["isthmus embedded"] = _run("client_metrics.py", _through(server), metrics_args)
        metrics["isthmus embedded"].update(_run("colocated.py", _through(server),
                                                colocated_args))
        shared = _run("client_metrics.py", _through(server, shared=True), metrics_args)
        for key in [k for k in shared if k.startswith("put_")]:
            metrics["isthmus embedded"][key.replace("_GBps", "_shared_memory_GBps")] = shared[key]
        curves["isthmus embedded"] = paired_curves(
            lambda: _run("threshold.py", _local(), [sizes, "4", seconds]),
            lambda: _run("threshold.py", _through(server), [sizes, "4", seconds]), rounds)
        compile_times["embedded cold"] = _run("compile_cache.py", _through(server), [])
        compile_times["embedded cached"] = _run("compile_cache.py", _through(server), [])
    with LocalServer(devices=None, fleet=(2, 2, 1)) as server:
        metrics["isthmus fleet 2x2"] = _run("client_metrics.py", _through(server), metrics_args)
        metrics["isthmus fleet 2x2"].update(_run("colocated.py", _through(server),
                                                 colocated_args))
        curves["isthmus fleet 2x2"] = paired_curves(
            lambda: _run("threshold.py", _local(4), [sizes, "4", seconds, "4"]),
            lambda: _run("threshold.py", _through(server), [sizes, "4", seconds, "4"]), rounds)
    compile_times["local"] = _run("compile_cache.py", _local(), [])
    # The persistent cache (--compile-cache): the same program in a fresh server process.
    with tempfile.TemporaryDirectory(prefix="isthmus-bench-cache-") as cache:
        for label in ("persistent cold", "after restart"):
            with LocalServer(devices=1, args=["--compile-cache", cache]) as server:
                compile_times[f"embedded {label}"] = _run("compile_cache.py",
                                                          _through(server), [])
        for label in ("persistent cold", "after restart"):
            with LocalServer(devices=None, fleet=(2, 2, 1),
                             args=["--compile-cache", cache + "/fleet"]) as server:
                compile_times[f"fleet 2x2 {label}"] = _run("compile_cache.py",
                                                           _through(server), [])
    # The same loop on simulated accelerators: no compute on the CPU (see simulated_curve).
    simulated: dict[str, tuple[dict, list[float]]] = {}
    rate = f"--simulate-flops={SIMULATED_FLOPS:g}"
    with LocalServer(devices=1, args=[rate]) as server:
        simulated["isthmus embedded"] = simulated_curve(
            server, SIMULATED_SIZES, seconds, 1, SIMULATED_FLOPS, rounds)
    with LocalServer(devices=None, fleet=(2, 2, 1),
                     args=[f"--simulate-flops={SIMULATED_FLOPS / 4:g}"]) as server:
        simulated["isthmus fleet 2x2"] = simulated_curve(
            server, SIMULATED_SIZES, seconds, 4, SIMULATED_FLOPS / 4, rounds)

    # The data-parallel loop against its honest peer (bench/dp_loop.py, bench/peer.py):
    # multi-controller JAX on the same 2 processes x 4 devices, in paired rounds.
    data_parallel = dp_against_peer(150 if quick else 300, 1 if quick else 3,
                                    normal_gloo=not quick)
    # Two slices at once from one program (bench/slices.py, examples/rl_loop.py).
    slices = {"local jax 8 devices": _run("slices.py", _local(8), metrics_args)}
    with LocalServer(devices=None, fleet=(2, 1, 4)) as server:
        slices["isthmus fleet 2x1x4"] = _run("slices.py", _through(server), metrics_args)
    # Each slice on CPUs of its own, as slices on separate hardware are (--pin-slices).
    with LocalServer(devices=None, fleet=(2, 1, 4), args=["--pin-slices"]) as server:
        slices["fleet 2x1x4, pinned"] = _run("slices.py", _through(server), metrics_args)

    from bench.scaling import run as scaling

    hosts = [16, 64, 256, 1024]
    scale = scaling(hosts, 0.3 if quick else 2.0)

    # The shared service (bench/shared.py): its own servers and client processes.
    from bench import shared as shared_service

    began = time.monotonic()
    service = shared_service.run(quick)
    STAGES.append(("shared.py", time.monotonic() - began))

    # A real model against its peer: MaxText through the fleet and as multi-controller
    # MaxText (bench/maxtext_peer.py; in the workloads environment, where MaxText is).
    from bench import maxtext_peer

    began = time.monotonic()
    maxtext = maxtext_peer.run(20 if quick else 30, 1 if quick else 3)
    STAGES.append(("maxtext_peer.py", time.monotonic() - began))

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {'quick' if quick else 'full'} mode; medians")
    columns = list(metrics)
    keys = list(dict.fromkeys(k for row in metrics.values() for k in row))
    print(f"\n{'metric':34}" + "".join(f"{c:>20}" for c in columns))
    for key in keys:
        cells = []
        for column in columns:
            value = metrics[column].get(key)
            cells.append(f"{value:20.3f}" if isinstance(value, (int, float)) else f"{'-':>20}")
        print(f"{key:34}" + "".join(cells))

    print(f"\ndispatch threshold (pipelined steps of 4 chained n x n matmuls; median of "
          f"{rounds} paired rounds):")
    print(f"{'n':>6}" + "".join(f"{'local ms':>10}{name + ' / local':>30}" for name in curves))
    first = next(iter(curves.values()))[0]
    for i, n in enumerate(first["sizes"]):
        print(f"{n:6d}" + "".join(f"{local['step_ms'][i]:10.3f}{ratios[i]:30.2f}"
                                  for local, ratios in curves.values()))
    thresholds = {}
    for name, (local, ratios) in curves.items():
        found = threshold(local["step_ms"], ratios)
        thresholds[name] = found
        text = f"{found:.3f} ms of compute per step" if found else "not reached in this range"
        print(f"  {name}: keeps >= 95% of local jax from {text}")

    print(f"\ndispatch threshold on simulated accelerators (the same steps; each device "
          f"runs {SIMULATED_FLOPS:.0e} FLOP/s\nwithout CPU, so the reference is the device "
          f"time itself; median of {rounds} rounds):")
    print(f"{'n':>6}{'device ms':>10}" + "".join(f"{name + ' / device':>30}"
                                                  for name in simulated))
    first = next(iter(simulated.values()))[0]
    for i, n in enumerate(first["sizes"]):
        print(f"{n:6d}{first['step_ms'][i]:10.3f}" + "".join(
            f"{ratios[i]:30.2f}" for _, ratios in simulated.values()))
    for name, (local, ratios) in simulated.items():
        found = threshold(local["step_ms"], ratios)
        thresholds[f"{name}, simulated accelerator"] = found
        text = f"{found:.3f} ms of device time per step" if found else "not reached"
        print(f"  {name}: keeps >= 95% of the device busy from {text}")

    print(dp_report(data_parallel))
    print(maxtext_peer.report(maxtext))
    print("\ntwo slices from one program (bench/slices.py): the slice-to-slice copy of 64 MiB "
          "of weights,\nand examples/rl_loop.py's learner and sampler alone and at once "
          "(overlap: their sum / at once):")
    keys = ("weight_copy_GBps", "learner_s", "sampler_s", "both_s", "overlap")
    print(f"{'':24}" + "".join(f"{k:>18}" for k in keys))
    for name, row in slices.items():
        print(f"{name:24}" + "".join(f"{row[k]:18.3f}" for k in keys))
    print("\n".join(slices_targets(slices)))

    print("\ncontroller scaling (in-process, stand-in workers, one program over all hosts):")
    for n in hosts:
        print(f"  {n:5d} hosts: {scale[n]:9.0f} programs/s  ({scale[n] / scale[hosts[0]]:.1%} "
              f"of {hosts[0]} hosts)")

    print()
    print("\n".join(shared_service.report(service)))

    print("\ncompilation of one program (ms):")
    for name, value in compile_times.items():
        print(f"  {name:26} {value['compile_ms']:9.1f}")

    results.update({"client": metrics,
                    "threshold_curves": {name: {"sizes": local["sizes"],
                                                "local_step_ms": local["step_ms"],
                                                "ratio_to_local": ratios}
                                         for name, (local, ratios) in curves.items()},
                    "simulated_threshold_curves": {
                        name: {"sizes": local["sizes"], "device_step_ms": local["step_ms"],
                               "ratio_to_device": ratios}
                        for name, (local, ratios) in simulated.items()},
                    "threshold_ms": thresholds, "scaling_programs_per_s": scale,
                    "data_parallel": data_parallel, "maxtext": maxtext, "two_slices": slices,
                    "shared_service": service,
                    "compile_ms": {k: v["compile_ms"] for k, v in compile_times.items()}})
    (OUT / "results.json").write_text(json.dumps(results, indent=2))
    png = plot({**{name: (local["step_ms"], ratios) for name, (local, ratios) in curves.items()},
                **{f"{name}, simulated accelerator": (local["step_ms"], ratios)
                   for name, (local, ratios) in simulated.items()}},
               OUT / "dispatch_threshold.png")
    print("\nseconds per stage: " + ", ".join(f"{w} {t:.0f}" for w, t in STAGES),
          file=sys.stderr)
    print(f"\nJSON: {OUT / 'results.json'}   plot: {png}   "
          f"({time.monotonic() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
