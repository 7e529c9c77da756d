"""python -m bench [--quick] [--json PATH]: isthmus beside local jax, in one run.

Runs the same client measurements (bench/client_metrics.py) on local jax, through an
embedded isthmus server, and through a local fleet of 2 slices x 2 hosts, and prints one
table. It also reports the controller's CPU time per dispatched program, read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

from isthmus.cli import child_environment
from isthmus.testing import LocalServer

HERE = pathlib.Path(__file__).parent


def run_client(env: dict[str, str], quick: bool) -> dict[str, float]:
    args = [sys.executable, str(HERE / "client_metrics.py")] + (["--quick"] if quick else [])
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"benchmark client failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def through(server: LocalServer, base: dict[str, str], quick: bool) -> dict[str, float]:
    assert server.process is not None
    env = child_environment(server.address, base)
    env["ISTHMUS_BENCH_SERVER_PID"] = str(server.process.pid)
    return run_client(env, quick)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", default="bench/out/results.json")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}
    results = {"local jax": run_client({**base, "JAX_PLATFORMS": "cpu"}, args.quick)}
    with LocalServer(devices=1) as server:
        results["isthmus embedded"] = through(server, base, args.quick)
    with LocalServer(devices=None, fleet=(2, 2, 1)) as server:
        results["isthmus fleet 2x2"] = through(server, base, args.quick)
    columns = list(results)
    metrics = list(results["isthmus embedded"])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; medians of repeated runs")
    print(f"{'metric':34}" + "".join(f"{c:>20}" for c in columns))
    for key in metrics:
        cells = []
        for column in columns:
            value = results[column].get(key)
            cells.append(f"{value:20.3f}" if value is not None else f"{'-':>20}")
        print(f"{key:34}" + "".join(cells))
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
