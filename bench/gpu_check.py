"""python -m bench.gpu_check: local jax vs isthmus on the same GPU, in one run.

Run it by hand on a machine with an NVIDIA GPU where jax and its CUDA plugin are installed
(`scripts/gpu-check`, which installs nothing). It starts an embedded isthmus backend on one
GPU and a local fleet of two slices of one worker each, both workers sharing that GPU, and
measures the same client programs on each and on local jax:

- a training loop (value_and_grad + SGD on an MLP) on one device: final loss and weights
  must be bit-identical to local jax; on the fleet also data parallel over both workers
  (NCCL between the two processes; on one shared GPU NCCL refuses this, and the check
  reports it), compared with local jax to a tolerance;
- pipelined calls per second, jit+block and jit+fetch latency, 256 MiB put and fetch;
- the dispatch-threshold curve: pipelined steps of 4 chained n x n matmuls, n = 256 .. 8192;
- through isthmus, the colocated Python examples (a data loader feeding the GPUs, a
  checkpoint writer) on the GPUs' colocated CPU devices, which check their own results.

Prints a table and writes JSON (bench/out/gpu_check.json unless --json says otherwise).
`--platform cpu` runs the same on the CPU (a smoke test of the script on any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform as host_platform
import statistics
import subprocess
import sys
import time

from isthmus.serve import child_environment
from isthmus.testing import LocalServer

HERE = pathlib.Path(__file__).parent
STAGES: list[tuple[str, float]] = []


def _run(script: str, env: dict[str, str], args: list[str], timeout: float = 600) -> dict:
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(HERE / script), *args], env=env,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    STAGES.append((f"{script} {' '.join(args)}", time.monotonic() - start))
    return json.loads(result.stdout.strip().splitlines()[-1])


COLOCATED = ("colocated_data_loader.py", "colocated_checkpoint_writer.py")


def _example(example: str, env: dict[str, str]) -> dict:
    """Runs one of examples/ (which check their own results): ok, seconds, last line."""
    import tempfile

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as directory:
        result = subprocess.run([sys.executable, str(HERE.parent / "examples" / example),
                                 directory], env=env, capture_output=True, text=True,
                                timeout=300)
    lines = (result.stdout if result.returncode == 0 else result.stderr).strip().splitlines()
    return {"ok": result.returncode == 0, "s": round(time.monotonic() - start, 2),
            "last": lines[-1][:300] if lines else ""}


def _base() -> dict[str, str]:
    drop = ("JAX_PLATFORMS", "JAX_BACKEND_TARGET", "XLA_FLAGS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _local(platform: str) -> dict[str, str]:
    env = {**_base(), "JAX_PLATFORMS": platform}
    if platform == "cpu":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    return env


def _through(server: LocalServer) -> dict[str, str]:
    env = child_environment(server.address, _base())
    env["ISTHMUS_BENCH_SERVER_PID"] = str(server.process.pid)  # type: ignore[union-attr]
    return env


def measure(name: str, env: dict[str, str], plan: dict) -> dict:
    out: dict = {}
    out["train_1"] = _run("gpu_train.py", env, [str(plan["steps"]), "1", plan["widths"]])
    if name != "isthmus embedded":  # the fleet's two workers (local jax: what it has)
        try:
            out["train_2"] = _run("gpu_train.py", env, [str(plan["steps"]), "2",
                                                        plan["widths"]])
        except RuntimeError as e:  # NCCL refuses two ranks on one GPU
            out["train_2"] = {"error": str(e).strip().splitlines()[-1][:300]}
    if name != "local jax":  # colocated Python on the GPUs' colocated CPU devices
        out["colocated"] = {example: _example(example, env) for example in COLOCATED}
    out["client"] = _run("client_metrics.py", env, plan["metrics_args"])
    out["threshold"] = _run("threshold.py", env, [plan["sizes"], "4", plan["seconds"]])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer steps and sizes")
    parser.add_argument("--json", default=str(HERE / "out" / "gpu_check.json"))
    args = parser.parse_args()
    start = time.monotonic()
    cuda = args.platform == "cuda"
    if cuda:
        plan = {"steps": 50 if args.quick else 200, "widths": "1024,4096,4096,1024",
                "sizes": "256,1024,4096" if args.quick else "256,512,1024,2048,4096,8192",
                "seconds": "0.5" if args.quick else "1.0",
                "metrics_args": ["--quick"] if args.quick else []}
    else:
        plan = {"steps": 20, "widths": "128,256,256,128", "sizes": "64,128,256",
                "seconds": "0.3", "metrics_args": ["--quick"]}
    server_args = ["--platform", args.platform]
    results: dict = {"machine": {"machine": host_platform.machine(), "cores": os.cpu_count(),
                                 "python": host_platform.python_version(),
                                 "platform": args.platform, "quick": args.quick}}
    runs: dict[str, dict] = {}
    runs["local jax"] = measure("local jax", _local(args.platform), plan)
    with LocalServer(devices=1, args=server_args) as server:
        runs["isthmus embedded"] = measure("isthmus embedded", _through(server), plan)
    fleet_args = [*server_args, "--gpus", "0"] if cuda else server_args
    with LocalServer(devices=None, fleet=(2, 1, 1), args=fleet_args) as server:
        runs["isthmus fleet 2x1"] = measure("isthmus fleet 2x1", _through(server), plan)
    results["runs"] = runs
    report(runs, results)
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"\nJSON: {path}  ({time.monotonic() - start:.0f} s in all; stages: "
          + ", ".join(f"{w.split()[0]} {t:.0f}s" for w, t in STAGES) + ")")
    return 0 if results["all_identical"] and results["colocated_ok"] else 1


def report(runs: dict[str, dict], results: dict) -> None:
    local = runs["local jax"]
    kind = local["train_1"]["device_kind"]
    print(f"local jax vs isthmus on {kind} ({local['train_1']['platform']}); medians\n")
    names = list(runs)
    print(f"{'metric':30}" + "".join(f"{n:>20}" for n in names))
    rows = [("train steps/s (1 device)", lambda r: r["train_1"]["steps_per_s"])]
    keys = list(local["client"])
    rows += [(k, lambda r, k=k: r["client"].get(k)) for k in keys]
    for label, get in rows:
        cells = []
        for n in names:
            value = get(runs[n])
            cells.append(f"{value:20.3f}" if isinstance(value, (int, float)) else f"{'-':>20}")
        print(f"{label:30}" + "".join(cells))
    identical = {}
    for n in names[1:]:
        mine, theirs = runs[n]["train_1"], local["train_1"]
        identical[n] = (mine["final_loss"] == theirs["final_loss"]
                        and mine["params_checksum"] == theirs["params_checksum"])
    print("\ntraining, one device, bit-identical to local jax: "
          + ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in identical.items()))
    fleet2 = runs["isthmus fleet 2x1"].get("train_2", {})
    if "error" in fleet2:
        print(f"training, data parallel over the fleet's 2 workers: failed ({fleet2['error']})"
              "; NCCL does not put two ranks of one communicator on the same GPU")
    if "final_loss" in fleet2 and "final_loss" in local.get("train_2", {}):
        ref = float.fromhex(local["train_2"]["final_loss"])
        got = float.fromhex(fleet2["final_loss"])
        results["fleet_2_device_loss_rel_diff"] = abs(got - ref) / max(abs(ref), 1e-30)
        via = "NCCL" if local["train_1"]["platform"] != "cpu" else "gloo"
        print(f"training, data parallel over the fleet's 2 workers ({via}): final loss "
              f"{got:.6g} vs local jax {ref:.6g} (rel. diff "
              f"{results['fleet_2_device_loss_rel_diff']:.2e})")
    print("\ndispatch threshold (4 chained n x n matmuls per step, pipelined):")
    sizes = local["threshold"]["sizes"]
    print(f"{'n':>6}{'local ms':>10}" + "".join(f"{n + ' / local':>28}" for n in names[1:]))
    ratios = {n: [m / t for m, t in zip(runs[n]["threshold"]["steps_per_s"],
                                        local["threshold"]["steps_per_s"])] for n in names[1:]}
    for i, size in enumerate(sizes):
        print(f"{size:6d}{local['threshold']['step_ms'][i]:10.3f}"
              + "".join(f"{ratios[n][i]:28.2f}" for n in names[1:]))
    colocated = {n: runs[n]["colocated"] for n in names[1:]}
    print("\ncolocated Python examples on the GPUs' colocated CPU devices: " + "; ".join(
        f"{n}: " + ", ".join(f"{e.split('_', 1)[1]} {'ok' if r['ok'] else 'FAILED'} "
                            f"({r['s']:.1f} s)" for e, r in c.items())
        for n, c in colocated.items()))
    for n, c in colocated.items():
        for e, r in c.items():
            if not r["ok"]:
                print(f"  {n} {e}: {r['last']}")
    results["identical"] = identical
    results["colocated_ok"] = all(r["ok"] for c in colocated.values() for r in c.values())
    results["all_identical"] = all(identical.values())
    results["threshold_ratios"] = ratios
    results["median_threshold_ratio"] = {n: statistics.median(r) for n, r in ratios.items()}


if __name__ == "__main__":
    sys.exit(main())
