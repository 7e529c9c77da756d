"""Real JAX software, unmodified, through isthmus and on local jax.

A workload is a script in `scripts/` that uses a library the way its users do (MaxText's
trainer, Tunix's GRPO learner, a Flax NNX model, Orbax, Equinox) and prints one line per
result it wants compared: `WORKLOAD {"name": ..., "value": ...}` (JSON). `run_workload`
runs it once through `isthmus run` on a fleet shape and once on local jax with 8 CPU
devices, each in a fresh process with a timeout, and returns both lists of records;
`assert_close` compares them.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PREFIX = "WORKLOAD "
LOCAL_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
# Fleet shapes (`isthmus run` arguments): the default fleet (1 slice x 2 hosts x 4 devices),
# two slices, and the embedded backend.
DEFAULT = ()
TWO_SLICES = ("--slices", "2", "--hosts-per-slice", "1", "--devices-per-host", "4")
EMBEDDED = ("--devices", "8")


def _run(command: list[str], env: dict[str, str], timeout: float, where: str,
         cwd: str | None = None) -> list[dict]:
    try:
        result = subprocess.run(command, env=env, text=True, capture_output=True,
                                timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"")[-8000:] if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"the workload hung {where} (no end within {timeout:.0f} s):\n"
                             f"--- stdout ---\n{str(out)[-4000:]}\n--- stderr ---\n"
                             f"{str(err)[-8000:]}") from None
    if result.returncode != 0:
        raise AssertionError(f"the workload failed {where} (exit {result.returncode}):\n"
                             f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n"
                             f"{result.stderr[-8000:]}")
    records = [json.loads(line[len(PREFIX):]) for line in result.stdout.splitlines()
               if line.startswith(PREFIX)]
    if not records:
        raise AssertionError(f"the workload printed no results {where}:\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return records


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_BACKEND_TARGET"):
        env.pop(key, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


# Local runs so far, by what they ran (two tests compare the same workload on two backends).
_LOCAL: dict[tuple, list[dict]] = {}


def run_local(script: str, args: Sequence[str] = (), *, timeout: float = 300.0,
              env: dict[str, str] | None = None, cwd: str | None = None) -> list[dict]:
    """The workload's records on local jax with 8 CPU devices (run once per test process for
    the same script, arguments, environment and folder)."""
    key = (script, tuple(args), tuple(sorted((env or {}).items())), cwd)
    if key not in _LOCAL:
        full = _env(env)
        full.update(LOCAL_ENV)
        _LOCAL[key] = _run([sys.executable, str(SCRIPTS / script), *args], full, timeout,
                           "on local jax", cwd)
    return copy.deepcopy(_LOCAL[key])


def run_isthmus(script: str, args: Sequence[str] = (), *, fleet: Sequence[str] = DEFAULT,
                timeout: float = 300.0, env: dict[str, str] | None = None,
                cwd: str | None = None) -> list[dict]:
    """The workload's records through `isthmus run` on a fleet shape (`fleet`: its
    arguments)."""
    command = [sys.executable, "-m", "isthmus.cli", "run", *fleet, "--",
               sys.executable, str(SCRIPTS / script), *args]
    return _run(command, _env(env), timeout, f"through isthmus run {' '.join(fleet)}", cwd)


def assert_close(got: list[dict], want: list[dict], *, rtol: float = 1e-6,
                 atol: float = 1e-6) -> None:
    """The same records in the same order, values equal within tolerance."""
    assert [r["name"] for r in got] == [r["name"] for r in want], (
        f"different results through isthmus and locally:\n{got}\n{want}")
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g["value"], dtype=np.float64),
                                   np.asarray(w["value"], dtype=np.float64),
                                   rtol=rtol, atol=atol, err_msg=g["name"])
