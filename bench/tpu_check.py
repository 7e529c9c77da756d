"""The TPU check (scripts/tpu-check): real work on the chip, through isthmus and on local
jax, one process at a time (one process may hold the chip), compared and tabled.

    python -m bench.tpu_check [--quick] [--out DIR]

Runs bench/tpu_work.py on local TPU jax, then through `isthmus run --platform tpu --devices
1` (the embedded backend, on a private Unix socket: the TPU machine lets no process open a
TCP socket). Results must be equal bit for bit (the same programs on the same chip); the
figures are tabled beside local jax's, with their ratio. Exit code 1 when a result differs or
a part failed. On a machine without TPU chips it says so and exits 0 (CI has none).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
WORK = HERE / "tpu_work.py"
RESULTS = ("mlp_losses", "matmul_small", "pallas", "offload", "offload_kind", "donating")
FIGURES = (  # (key, label, higher is better)
    ("mlp_steps_per_s", "MLP 784-512-512-10 steps/s", True),
    ("jit_fetch_p50_ms", "tiny jit + fetch p50 ms", False),
    ("put_GBps", "device_put GB/s", True),
    ("fetch_GBps", "fetch GB/s", True),
    ("matmul_tflops", "bf16 matmul TFLOP/s", True),
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
    local, local_s, _ = _run([sys.executable, str(WORK), *extra], base, 900)
    through, through_s, log = _run(
        [sys.executable, "-m", "isthmus.cli", "run", "--platform", "tpu", "--devices", "1",
         "--", sys.executable, str(WORK), *extra], base, 900)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tpu_check.json"), "w") as f:
        json.dump({"local": local, "isthmus_embedded": through,
                   "seconds": {"local": local_s, "isthmus_embedded": through_s}}, f)
    failures = [f"{where}: {key} {value[:1500]}" for where, run in
                (("local", local), ("isthmus", through))
                for key, value in run.items() if key.endswith("error")]
    print(f"TPU check: {local.get('device_kind', '?')}; local jax {local_s:.0f} s, "
          f"isthmus embedded {through_s:.0f} s (process start and chip opening included)")
    print(f"  {'result':34} {'equal bit for bit':>18}")
    for key in RESULTS:
        if key in local and key in through:
            equal = local[key] == through[key]
            if not equal:
                failures.append(f"{key} differs")
            print(f"  {key:34} {'yes' if equal else 'NO':>18}")
        else:
            print(f"  {key:34} {'missing':>18}")
            failures.append(f"{key} missing")
    print(f"  {'figure':34} {'local':>10} {'isthmus':>10} {'ratio':>7}")
    for key, label, higher in FIGURES:
        a, b = local.get(key), through.get(key)
        if isinstance(a, float) and isinstance(b, float) and a and b:
            ratio = b / a if higher else a / b
            print(f"  {label:34} {a:10.3f} {b:10.3f} {ratio:7.2f}")
        else:
            print(f"  {label:34} {'-':>10} {'-':>10}")
    print("  (ratio: isthmus as a share of local; 1.00 is as fast)")
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures and log:
        print("--- the server's and client's log, last lines ---\n" + log[-4000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
