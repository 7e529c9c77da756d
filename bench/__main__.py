"""python -m bench [--quick] [--json PATH]: isthmus beside local jax, in one run."""

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", default="bench/out/results.json")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}
    local = run_client({**base, "JAX_PLATFORMS": "cpu"}, args.quick)
    with LocalServer(devices=1) as server:
        remote = run_client(child_environment(server.address, base), args.quick)
    rows = []
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; single-host embedded server")
    print(f"{'metric':28} {'isthmus':>12} {'local jax':>12} {'ratio':>8}")
    for key in local:
        ratio = remote[key] / local[key] if local[key] else float("nan")
        rows.append({"metric": key, "isthmus": remote[key], "local": local[key], "ratio": ratio})
        print(f"{key:28} {remote[key]:12.3f} {local[key]:12.3f} {ratio:8.2f}")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
