"""The TPU check (scripts/tpu-check): real work on the chip, through isthmus and on local
jax, one process at a time (one process may hold the chip), compared and tabled.

    python -m bench.tpu_check [--quick] [--out DIR]

Runs bench/tpu_work.py on local TPU jax, then through `isthmus run --platform tpu --devices
1` (the embedded backend) and `isthmus run --platform tpu` (a one-host fleet: a worker
process owns the chip), each on a private Unix socket (the TPU machine lets no process open
a TCP socket; the fleet's own streams use Unix sockets there too). Results must be equal bit
for bit (the same programs on the same chip); the figures are tabled beside local jax's,
with their ratio. Exit code 1 when a result differs or a part failed. On a machine without
TPU chips it says so and exits 0 (CI has none).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
WORK = HERE / "tpu_work.py"
RESULTS = ("mlp_losses", "matmul_small", "pallas", "offload", "offload_kind", "donating",
           "checkpoint_steps", "checkpoint", "profile_names_program", "lm_losses",
           "lm_param_abs_sum")
# Where flax (the language model) and orbax (the checkpoint) are installed.
OPTIONAL = ("lm_losses", "lm_param_abs_sum", "checkpoint_steps", "checkpoint")
SELF_CHECKED = ("colocated",)  # through isthmus only: equal to its "_expected" (numpy's)
FIGURES = (  # (key, label, higher is better)
    ("mlp_steps_per_s", "MLP 784-512-512-10 steps/s", True),
    ("jit_block_p50_ms", "tiny jit + block p50 ms", False),
    ("jit_fetch_p50_ms", "tiny jit + fetch p50 ms", False),
    ("fetch_ready_p50_ms", "fetch of a computed result p50 ms", False),
    ("put_GBps", "device_put GB/s", True),
    ("fetch_GBps", "fetch GB/s", True),
    ("matmul_tflops", "bf16 matmul TFLOP/s", True),
    ("lm_seconds", "Flax NNX LM, 20 steps, s", False),
)


def _run(command: list[str], env: dict[str, str], timeout: float) -> tuple[dict, float, str]:
    start = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True,
                            timeout=timeout)
    took = time.monotonic() - start
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        return ({"error": f"exit {result.returncode}: {result.stderr[-3000:]}"}, took,
                result.stderr)
    return json.loads(lines[-1]), took, result.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers and matmul")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "out"),
                        help="where the JSON of both runs goes (default: $OUT, or bench/out)")
    args = parser.parse_args()
    from isthmus.compat import jax as jax_compat
    from isthmus.worker.platforms import libtpu_installed

    if not libtpu_installed() or jax_compat.tpu_chips() == 0:
        print("tpu-check: no TPU here (libtpu or chips missing); nothing to check")
        return 0
    extra = ["--quick"] if args.quick else []
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET")}
    # Through isthmus, pathwaysutils' persistence: the workers write the checkpoint's shards.
    base["ENABLE_PATHWAYS_PERSISTENCE"] = "1"
    local, local_s, _ = _run([sys.executable, str(WORK), *extra], base, 900)
    runs = {"local": (local, local_s, "")}
    for name, shape in (("embedded", ["--devices", "1"]), ("fleet", [])):
        # The embedded backend, then a one-host fleet (a worker process owning the chip;
        # on a machine without TCP, its control stream and group formation on Unix sockets).
        runs[name] = _run([sys.executable, "-m", "isthmus.cli", "run", "--platform", "tpu",
                           *shape, "--", sys.executable, str(WORK), *extra], base, 900)
    # The compile cache across a restart, on the chip: a training step compiled by a fresh
    # server (cold), then by a new one on the same cache (each its own client process).
    cache = os.path.join(args.out, "tpu-compile-cache")
    shutil.rmtree(cache, ignore_errors=True)
    compiles = []
    for _ in range(2):
        result, _, _ = _run([sys.executable, "-m", "isthmus.cli", "run", "--platform", "tpu",
                             "--devices", "1", "--compile-cache", cache, "--",
                             sys.executable, str(HERE / "compile_cache.py"), "mlp"], base, 300)
        compiles.append(result.get("compile_ms"))
    # What the machine charges for a round trip with neither isthmus nor jax: every wait
    # of the stock client costs at least its stream figure.
    echo = subprocess.run([sys.executable, str(HERE / "echo_floor.py"), "2000"], env=base,
                          capture_output=True, text=True, timeout=120)
    floor = (json.loads(echo.stdout.strip().splitlines()[-1]) if not echo.returncode
             else {"error": echo.stderr[-1500:]})
    # A second TPU client in a live process, as a worker whose group re-forms makes one.
    second = subprocess.run([sys.executable, str(HERE / "tpu_second_client.py")], env=base,
                            capture_output=True, text=True, timeout=300)
    second_client = (json.loads(second.stdout.strip().splitlines()[-1]) if not second.returncode
                     else {"error": second.stderr[-1500:]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tpu_check.json"), "w") as f:
        json.dump({name: run for name, (run, _, _) in runs.items()}
                  | {"seconds": {name: s for name, (_, s, _) in runs.items()},
                     "compile_ms": compiles, "second_client": second_client,
                     "echo_floor": floor}, f)
    failures = [f"{where}: {key} {value[:1500]}" for where, (run, _, _) in runs.items()
                for key, value in run.items() if key.endswith("error")]
    # Each run's standard error (isthmus's server and workers log there) beside the JSON;
    # its ERROR lines are printed below the table, since a run can succeed past one (a
    # collective group formed again, say).
    logged: dict[str, list[str]] = {}
    for name, (_, _, stderr) in runs.items():
        if name == "local":
            continue
        with open(os.path.join(args.out, f"stderr-{name}.txt"), "w") as f:
            f.write(stderr)
        logged[name] = [line for line in stderr.splitlines() if " ERROR " in line]
    print(f"TPU check: {local.get('device_kind', '?')}; "
          + ", ".join(f"{name} {s:.0f} s" for name, (_, s, _) in runs.items())
          + " (process start and chip opening included)")
    mine = [name for name in runs if name != "local"]
    print(f"  {'result, equal bit for bit to local':42}"
          + "".join(f" {name:>10}" for name in mine))
    for key in SELF_CHECKED:
        cells = []
        for name in mine:
            run = runs[name][0]
            cells.append("yes" if key in run and run[key] == run.get(f"{key}_expected")
                         else "NO")
            if cells[-1] == "NO":
                failures.append(f"{name}: {key} differs from numpy's")
        print(f"  {key + ' (equal to numpy)':42}" + "".join(f" {cell:>10}" for cell in cells))
    for key in RESULTS:
        cells = []
        for name in mine:
            run = runs[name][0]
            if key not in local and key in OPTIONAL:
                cells.append("-")
            elif key in local and key in run:
                cells.append("yes" if local[key] == run[key] else "NO")
            else:
                cells.append("missing")
            if cells[-1] in ("NO", "missing"):
                failures.append(f"{name}: {key} {'differs' if cells[-1] == 'NO' else 'missing'}")
        print(f"  {key:42}" + "".join(f" {cell:>10}" for cell in cells))
    print(f"  {'figure':34} {'local':>10}" + "".join(f" {name:>10} {'ratio':>6}"
                                                     for name in mine))
    for key, label, higher in FIGURES:
        a = local.get(key)
        row = f"  {label:34} " + (f"{a:10.3f}" if isinstance(a, float) else f"{'-':>10}")
        for name in mine:
            b = runs[name][0].get(key)
            if isinstance(a, float) and isinstance(b, float) and a and b:
                row += f" {b:10.3f} {(b / a if higher else a / b):6.2f}"
            else:
                row += f" {'-':>10} {'':>6}"
        print(row)
    print("  (ratio: isthmus as a share of local; 1.00 is as fast)")
    print(f"  the machine's round trip between two grpcio processes (bench/echo_floor.py), "
          f"p50 ms: {floor}; each wait of the stock client costs at least its stream figure")
    if all(isinstance(c, float) for c in compiles):
        print(f"  compile of the MLP step, embedded, --compile-cache: cold {compiles[0]:.0f} ms, "
              f"after a restart {compiles[1]:.0f} ms ({compiles[1] / compiles[0]:.2f}x)")
    else:
        failures.append(f"the compile cache's runs failed: {compiles}")
    for name in mine:
        run = runs[name][0]
        print(f"  {name}: profile traces {run.get('profile_hosts')}, a TPU plane in them: "
              f"{run.get('profile_tpu_plane')}")
    print(f"  a second TPU client in a live process: {second_client}")
    for name, lines in logged.items():
        if lines:
            print(f"  {name}: {len(lines)} ERROR lines in its log (stderr-{name}.txt), "
                  f"the first: {lines[0][:300]}")
    log = "".join(runs[name][2][-2000:] for name in mine)
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures and log:
        print("--- the server's and client's log, last lines ---\n" + log[-4000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
