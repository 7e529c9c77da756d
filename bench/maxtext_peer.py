"""MaxText through the default fleet beside multi-controller MaxText (issue 40, item 1).

    python -m bench.maxtext_peer [STEPS] [ROUNDS]

The workloads tier's MaxText model (bench/maxtext_step.py), trained for STEPS steps (default
30) in ROUNDS paired rounds (default 3), each round running it three ways on this machine:

- `isthmus fleet 1x2x4`: one client through the default fleet (1 slice x 2 hosts x 4 CPU
  devices), with the shared-memory variables `isthmus run` sets;
- `multi-controller 2x4`: its peer, MaxText as a multi-controller job on the same 2
  processes x 4 devices (`jax.distributed`, gloo), each process feeding its own data;
- `fleet, --pin-hosts`: the same fleet with each host's worker on CPUs of its own (on this
  machine's 2 cores, one each), as hosts on separate machines are;
- `local jax 8 devices`: one process, for scale.

A run's step time is the median of MaxText's own `perf/step_time_seconds` over the steps
after the fifth (compilation and warm-up before); steps/s and tokens/s follow from it. The
ratio `fleet / multi-controller` is the median of each round's ratio. Prints a table and a
JSON line; no figure is a test assertion.

MaxText lives in the workloads environment (scripts/test makes it: .venv-new). Run from a
Python without it, this module runs itself under ISTHMUS_MAXTEXT_PYTHON or .venv-new's
Python, or reports that it cannot.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
SHARED_ENV = ("IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY",
              "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES")
WARMUP = 5  # steps left out of a run's median: compilation and the first dispatches
FLEET, PEER, LOCAL = "isthmus fleet 1x2x4", "multi-controller 2x4", "local jax 8 devices"
PINNED = "fleet, --pin-hosts"


def workloads_python() -> str | None:
    """A Python with MaxText: this one, ISTHMUS_MAXTEXT_PYTHON, or .venv-new's."""
    if importlib.util.find_spec("maxtext") is not None:
        return sys.executable
    for candidate in (os.environ.get("ISTHMUS_MAXTEXT_PYTHON"),
                      str(ROOT / ".venv-new" / "bin" / "python")):
        if candidate and os.access(candidate, os.X_OK) and subprocess.run(
                [candidate, "-c", "import maxtext"], capture_output=True).returncode == 0:
            return candidate
    return None


def _base() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET", *SHARED_ENV)}


def _step(env: dict[str, str], steps: int) -> dict:
    result = subprocess.run([sys.executable, str(HERE / "maxtext_step.py"), str(steps)],
                            env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise RuntimeError(f"maxtext_step.py failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _summary(run: dict) -> dict[str, float]:
    step = statistics.median(run["step_s"][WARMUP:])
    return {"step_ms": step * 1e3, "steps_per_s": 1 / step,
            "tokens_per_s": run["tokens_per_step"] / step}


def measure(steps: int, rounds: int) -> dict:
    """The three ways in `rounds` paired rounds, in this (the workloads) Python."""
    from bench.peer import run_peer
    from isthmus.testing import LocalServer

    runs: dict[str, list[dict]] = {FLEET: [], PINNED: [], PEER: [], LOCAL: []}
    local = {**_base(), "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    with LocalServer(devices=None, fleet=(1, 2, 4)) as server, \
            LocalServer(devices=None, fleet=(1, 2, 4), args=["--pin-hosts"]) as pinned:
        through, through_pinned = _through(server), _through(pinned)
        for _ in range(rounds):
            runs[PEER].append(_summary(run_peer("maxtext_step.py", 2, 4, [str(steps)],
                                                base=_base())))
            runs[FLEET].append(_summary(_step(through, steps)))
            runs[PINNED].append(_summary(_step(through_pinned, steps)))
            runs[LOCAL].append(_summary(_step(local, steps)))
    table = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
             for name, rs in runs.items()}
    ratios = {name: [f["steps_per_s"] / p["steps_per_s"] for f, p in zip(runs[name], runs[PEER])]
              for name in (FLEET, PINNED)}
    return {"table": table, "ratios": ratios[FLEET], "ratio": statistics.median(ratios[FLEET]),
            "pinned_ratios": ratios[PINNED],
            "pinned_ratio": statistics.median(ratios[PINNED]), "steps": steps,
            "rounds": rounds}


def _through(server: object) -> dict[str, str]:
    """A client's environment for `server` (a LocalServer), with the shared-memory
    variables `isthmus run` sets."""
    from isthmus.serve import child_environment

    env = child_environment(server.address, _base())  # type: ignore[attr-defined]
    env[SHARED_ENV[0]] = server.status()["shared_dir"]  # type: ignore[attr-defined]
    env[SHARED_ENV[1]] = str(1 << 20)
    return env


def run(steps: int = 30, rounds: int = 3) -> dict | str:
    """The figures (`measure`), from the workloads Python; or why there are none."""
    python = workloads_python()
    if python is None:
        return ("MaxText is not installed here (it is in the workloads environment, "
                ".venv-new, that scripts/test makes; or set ISTHMUS_MAXTEXT_PYTHON)")
    if python == sys.executable:
        return measure(steps, rounds)
    result = subprocess.run([python, "-m", "bench.maxtext_peer", str(steps), str(rounds)],
                            cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        return f"bench.maxtext_peer failed:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(figures: dict | str) -> str:
    if isinstance(figures, str):
        return f"\nMaxText (bench/maxtext_peer.py): not run: {figures}"
    lines = [f"\nMaxText's 2-layer decoder (the workloads tier's, synthetic data), "
             f"{figures['steps']} steps, median step after the {WARMUP}th, "
             f"{figures['rounds']} paired rounds:",
             f"{'':24}{'step ms':>12}{'steps/s':>12}{'tokens/s':>12}"]
    for name, row in figures["table"].items():
        lines.append(f"{name:24}{row['step_ms']:12.1f}{row['steps_per_s']:12.2f}"
                     f"{row['tokens_per_s']:12.0f}")
    for label, key in (("fleet", "ratio"), ("fleet, --pin-hosts", "pinned_ratio")):
        each = ", ".join(f"{r:.2f}" for r in figures[key.replace("ratio", "ratios")])
        lines.append(f"  {label} / multi-controller, steps/s: {figures[key]:.2f}x "
                     f"(rounds: {each}; goal >= 1.1)")
    return "\n".join(lines)


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    started = time.monotonic()
    figures = run(steps, rounds)
    print(report(figures), file=sys.stderr if isinstance(figures, dict) else sys.stdout)
    if isinstance(figures, dict):
        print(json.dumps(figures))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0 if isinstance(figures, dict) else 1


if __name__ == "__main__":
    sys.exit(main())
