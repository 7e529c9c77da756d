"""Where a step's time goes on the chip, and the dispatch threshold there (issue 49).

    python -m bench.tpu_timeline [--out DIR] [--spy] [--seconds S] [--window S] [--warmup S]
    scripts/tpu-check --timeline          # the same, with the TPU machine's wheels

Runs, each on local TPU jax, through the embedded backend (`isthmus run --platform tpu
--devices 1`) and through a one-host fleet (`isthmus run --platform tpu`: a worker process
owns the chip), one process holding the chip at a time:

- bench/step_timeline.py: the MLP step's wall time pipelined, the chip's own time per step,
  one step waited for, and the CPU time per step of the client, the server and the worker
  (and of their busiest threads);
- bench/worker_step.py (part `worker`): the MLP step applied by a worker's command applier in
  process, no sockets, against jaxlib's call alone: isthmus's own share of a step on the chip;
- bench/threshold.py: pipelined steps of 4 chained n x n f32 matmuls for growing n, the
  curve of isthmus's steps/s as a share of local's against local's time per step, and the
  smallest step from which isthmus keeps 95% of local's rate (Pathways reports 2.3 ms).

With --spy (py-spy on PATH or importable), the fleet's and the embedded backend's timeline
runs are also sampled by `py-spy record --subprocesses --format raw` (collapsed stacks in
DIR, for a flame graph). The JSON of every run goes to DIR/tpu_timeline.json as each run
ends. Exits 0 with a note where there is no TPU. On the TPU v5e sandbox the default parts
took about 4 minutes with 0.5 s windows, `--parts lm,curve --rounds 3` more than 9 (past
one device call's limit: run the curve's rounds in calls of their own); with the 1.5 s
windows and 1.5 s warm-ups of now (`--window`, `--warmup`), a round of the curve should take
3-4 minutes (not yet run there).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

from bench.__main__ import threshold
from bench.tpu_check import _run

HERE = pathlib.Path(__file__).parent
SIZES = "128,512,1024,1536,1792,2048,2304,2560,2816,3072,4096"
BACKENDS = {"embedded": ["--devices", "1"], "fleet": []}


def _through(name: str, command: list[str], spy: str | None, out: str) -> list[str]:
    run = [sys.executable, "-m", "isthmus.cli", "run", "--platform", "tpu",
           *BACKENDS[name], "--", *command]
    if spy is None:
        return run
    return [spy, "record", "--subprocesses", "--format", "raw", "--rate", "250",
            "--nonblocking", "-o", os.path.join(out, f"spy-{name}.txt"), "--", *run]


def _spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    for entry in sys.path:  # pip install --target puts its binary in bin/ beside the site
        candidate = pathlib.Path(entry) / "bin" / "py-spy"
        if candidate.exists():
            return str(candidate)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "out"))
    parser.add_argument("--spy", action="store_true", help="sample the server with py-spy")
    parser.add_argument("--seconds", default="2", help="seconds of pipelined steps per run")
    # 0.5 s per size until 2026-12-07: a stall of ~200 ms about every 2 s in the embedded
    # server (bench/RESULTS.md, issue 49's seventh round) cost whichever size it fell in
    # 30-50% of its window, and read as slow sizes.
    parser.add_argument("--window", default="1.5",
                        help="seconds of pipelined steps per size of the threshold curve")
    # A one-time stop of ~200 ms about a second after a program starts running in the
    # embedded server (issue 49's eighth round) is warmed past, so the curve is steady state.
    parser.add_argument("--warmup", default="1.5",
                        help="seconds of unmeasured pipelined steps per size before its window")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of the threshold curve per backend, alternated (median)")
    parser.add_argument("--parts", default="worker,timeline,curve",
                        help="which of worker (a worker's own share of the MLP step, in "
                             "process: bench/worker_step.py), timeline, curve, lm (the "
                             "language model's time, broken down), stall (the embedded "
                             "server's stop, in detail), stall-ab (which ways of running the "
                             "step have it) to run")
    args = parser.parse_args()
    parts = args.parts.split(",")
    from isthmus.compat import jax as jax_compat
    from isthmus.worker.platforms import libtpu_installed

    if not libtpu_installed() or jax_compat.tpu_chips() == 0:
        print("tpu-timeline: no TPU here (libtpu or chips missing); nothing to measure")
        return 0
    os.makedirs(args.out, exist_ok=True)
    spy = _spy() if args.spy else None
    if args.spy and spy is None:
        print("tpu-timeline: py-spy not found; sampling left out")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET")}
    timeline_cmd = [sys.executable, str(HERE / "step_timeline.py"), args.seconds]
    curve_cmd = [sys.executable, str(HERE / "threshold.py"), SIZES, "4", args.window, "1",
                 args.warmup]
    lm_cmd = [sys.executable, str(HERE / "tpu_work.py"), "--only=lm"]
    runs: dict[str, dict] = {"timeline": {}, "curve": {}, "lm": {}}
    path = os.path.join(args.out, "tpu_timeline.json")

    def done(part: str, name: str, result: dict) -> None:
        """Keeps one run's result, written at once with its time (a call cut short by its
        limit still leaves what finished)."""
        runs[part][name] = result
        with open(path, "w") as f:
            json.dump(runs, f)
        print(f"tpu-timeline: {part} {name} done at {time.monotonic() - began:.0f} s"
              + (" (failed)" if "error" in result else ""), flush=True)

    began = time.monotonic()
    if "worker" in parts:
        worker = subprocess.run(
            [sys.executable, str(HERE / "worker_step.py"), "--platform", "tpu", "--sizes",
             "784,512,512,10", "--steps", "2000"], env=env, capture_output=True, text=True,
            timeout=300)
        line = (worker.stdout.strip().splitlines() or [f"failed: {worker.stderr[-2000:]}"])[-1]
        print(f"tpu-timeline: the MLP step in a worker, in process: {line}", flush=True)
    for part, command in (("timeline", timeline_cmd), ("lm", lm_cmd)):
        if part in parts:
            done(part, "local", _run(command, env, 300)[0])
            for name in BACKENDS:
                done(part, name, _run(_through(name, command, None, args.out), env, 300)[0])
    if "curve" in parts:
        rounds: dict[str, list[dict]] = {"local": [], **{name: [] for name in BACKENDS}}
        for _ in range(args.rounds):  # alternated, so that drift touches each alike
            rounds["local"].append(_run(curve_cmd, env, 300)[0])
            for name in BACKENDS:
                rounds[name].append(_run(_through(name, curve_cmd, None, args.out), env, 300)[0])
            for name, curves in rounds.items():
                done("curve", name, _median_curve(curves))
    if "stall" in parts:
        stall(args.out, env)
    if "stall-ab" in parts:
        stall_ab(args.out, env)
    if spy is not None:
        for name in BACKENDS:
            done("timeline", f"{name}-sampled",
                 _run(_through(name, timeline_cmd, spy, args.out), env, 300)[0])
    return report(runs)


def stall(out: str, env: dict[str, str]) -> None:
    """The embedded server's stalls (bench/RESULTS.md, issue 49's seventh round): windows of
    10 steps on local jax and through the embedded backend (matrices made on the device), and
    for the slowest of them what the server's main thread did, what each of its threads
    spent, and the main thread's state and system call every 5 ms (bench/phases); printed,
    and kept under OUT/phases."""
    folder = os.path.join(out, "phases")
    os.makedirs(folder, exist_ok=True)
    windows = [sys.executable, str(HERE / "phases" / "windows.py"), "2304,2816,4096", "2",
               "--on-device"]
    report = [sys.executable, str(HERE / "phases" / "report.py")]
    local = os.path.join(folder, "local.txt")
    with open(local, "w") as f:
        subprocess.run(windows, env=env, stdout=f, stderr=subprocess.DEVNULL, timeout=300)
    print("\nWindows of 10 steps, local jax", flush=True)
    subprocess.run([*report, folder + "/none", "--windows", local], env=env, timeout=120)
    threads, sizes = os.path.join(folder, "threads.jsonl"), os.path.join(folder, "sizes.txt")
    phased = {**env, "PYTHONPATH": os.pathsep.join([str(HERE / "phases"),
                                                    env.get("PYTHONPATH", "")]),
              "ISTHMUS_PHASES": folder, "ISTHMUS_PHASES_EVENTS": "1",
              "ISTHMUS_PHASES_SAMPLE": "1", "ISTHMUS_PHASES_EVERY": "0.5",
              "ISTHMUS_PHASES_REQUESTS": "1"}
    with open(sizes, "w") as f:
        subprocess.run(_through("embedded", [*windows, "--threads", threads], None, out),
                       env=phased, stdout=f, stderr=subprocess.DEVNULL, timeout=300)
    time.sleep(1.0)  # the timer's last snapshot
    print("\nWindows of 10 steps, embedded", flush=True)
    subprocess.run([*report, folder, "--windows", sizes, "--threads", threads], env=env,
                   timeout=120)


# Ways of running windows.py's step for stall_ab: (name, how: "local" jax, a DeviceHost
# alone in this machine's Python ("host"), or `isthmus run` with these arguments).
WAYS: tuple[tuple[str, str | list[str]], ...] = (
    ("local jax", "local"),
    ("a DeviceHost in one process (no server)", "host"),
    ("embedded", ["--devices", "1"]),
    ("embedded, grpc.aio client port", ["--devices", "1", "--client-transport", "grpc"]),
    ("one-host fleet", []),
)


def stall_ab(out: str, env: dict[str, str], size: str = "2816", seconds: str = "3") -> None:
    """Which ways of running the step have the embedded server's stop (one ~200 ms window
    about a second into a program's life, bench/RESULTS.md issue 49's eighth round): each
    runs one size for `seconds` from the program's start; printed per way, its time a step
    and its windows over 100 ms (when, how long). Local jax and the fleet had none there;
    a DeviceHost alone or the grpc.aio port without one would place it."""
    windows = [str(HERE / "phases" / "windows.py"), size, seconds, "--on-device"]
    print(f"\nThe stop, way by way: n = {size}, {seconds} s from the program's start",
          flush=True)
    for name, how in WAYS:
        if how == "host":
            command = [sys.executable, str(HERE / "phases" / "host_windows.py"), size, seconds,
                       "--platform", "tpu"]
        elif how == "local":
            command = [sys.executable, *windows]
        else:
            command = [sys.executable, "-m", "isthmus.cli", "run", "--platform", "tpu",
                       *how, "--", sys.executable, *windows]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=240)
        except subprocess.TimeoutExpired:
            print(f"  {name:44} timed out", flush=True)
            continue
        lines = [json.loads(line) for line in done.stdout.splitlines()
                 if line.startswith('{"n"')]
        if not lines:
            print(f"  {name:44} failed: {done.stderr.strip()[-300:]}", flush=True)
            continue
        run = lines[0]
        start = run["windows"][0][0]
        slow = [f"{(c - a) * 1e3:.0f} ms at {a - start:.2f} s (window {i})"
                for i, (a, _, c) in enumerate(run["windows"]) if c - a > 0.1]
        line = (f"  {name:44} {run['ms']:.3f} ms a step; over 100 ms: "
                + (", ".join(slow) if slow else "none"))
        print(line, flush=True)
        with open(os.path.join(out, "stall_ab.txt"), "a") as f:  # kept if the output is cut
            f.write(line + "\n")


def _median_curve(runs: list[dict]) -> dict:
    """The curve of several runs: each size's median step time (an error if any failed)."""
    failed = [run for run in runs if "error" in run]
    if failed:
        return failed[0]
    return {"sizes": runs[0]["sizes"], "rounds": len(runs),
            "step_ms": [statistics.median(run["step_ms"][i] for run in runs)
                        for i in range(len(runs[0]["sizes"]))]}


def report(runs: dict[str, dict]) -> int:
    failed = [f"{part} {name}: {run['error'][:2000]}" for part, by in runs.items()
              for name, run in by.items() if "error" in run]
    timeline = {n: r for n, r in runs["timeline"].items() if "error" not in r}
    if timeline:
        report_timeline(timeline)
    lm = {n: r for n, r in runs.get("lm", {}).items() if "error" not in r and "lm_seconds" in r}
    if lm:
        print("\nFlax NNX language model (20 steps, each reading its loss), seconds")
        print(f"  {'':40}" + "".join(f" {n:>10}" for n in lm))
        for key, label in (("lm_seconds", "in all"), ("lm_first_s", "making it, to the first loss"),
                           ("lm_step_ms", "a later step, ms (median)"),
                           ("lm_tail_s", "after the last loss")):
            print(f"  {label:40}" + "".join(f" {lm[n][key]:10.3f}" for n in lm))
        if "local" in lm:
            print("  losses equal to local's: " + ", ".join(
                f"{n} {lm[n]['lm_losses'] == lm['local']['lm_losses']}" for n in lm
                if n != "local"))
    curve = {n: r for n, r in runs["curve"].items() if "error" not in r}
    if "local" in curve:
        report_curve(curve)
    for failure in failed:
        print(f"FAILED: {failure}")
    return 1 if failed else 0


def report_timeline(timeline: dict[str, dict]) -> None:
    print("MLP step (784-512-512-10, batch 128, SGD), microseconds per step")
    names = list(timeline)
    print(f"  {'':34}" + "".join(f" {n:>16}" for n in names))
    for key, label in (("wall_us", "pipelined, wall"), ("chip_us", "the chip alone (scan of 50)"),
                       ("one_step_us", "one step waited for, p50")):
        print(f"  {label:34}" + "".join(f" {timeline[n][key]:16.0f}" for n in names))
    rows: dict[str, dict[str, float]] = {}
    for n in names:
        for role, threads in timeline[n]["cpu_us"].items():
            for thread, us in threads.items():
                rows.setdefault(f"CPU {role} {thread}", {})[n] = us
    for label, by in rows.items():
        print(f"  {label[:34]:34}" + "".join(
            f" {by[n]:16.0f}" if n in by else f" {'-':>16}" for n in names))
    if "local" in timeline:
        print("  steps/s as a share of local: " + ", ".join(
            f"{n} {timeline['local']['wall_us'] / timeline[n]['wall_us']:.2f}x"
            for n in names if n != "local"))


def report_curve(curve: dict[str, dict]) -> None:
    local = curve["local"]
    print("\nDispatch threshold: pipelined steps of 4 chained n x n f32 matmuls"
          + (f" (median of {local['rounds']} rounds)" if local.get("rounds", 1) > 1 else ""))
    print(f"  {'n':>6} {'local ms':>9}" + "".join(f" {n + ' x':>12}" for n in curve
                                                 if n != "local"))
    ratios = {n: [local["step_ms"][i] / r["step_ms"][i] for i in range(len(r["sizes"]))]
              for n, r in curve.items() if n != "local"}
    for i, size in enumerate(local["sizes"]):
        print(f"  {size:6d} {local['step_ms'][i]:9.3f}" + "".join(
            f" {ratios[n][i]:12.2f}" for n in ratios))
    for n, r in ratios.items():
        found = threshold(local["step_ms"], r)
        print(f"  {n}: keeps 95% of local from a step of "
              + (f"{found:.2f} ms" if found is not None else "none measured"))


if __name__ == "__main__":
    sys.exit(main())
