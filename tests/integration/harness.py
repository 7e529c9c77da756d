"""Differential testing: the same client code through isthmus and on local jax.

A snippet calls `emit(name, value)` for each result. `compare` runs it twice, in fresh
processes: once with the stock jax client pointed at an isthmus server, once on local jax
with 8 CPU devices, and asserts that every emitted value is identical (dtype, shape, bits).
"""

from __future__ import annotations

import os
import tempfile
import textwrap

import numpy as np

from isthmus.testing import run_python

PRELUDE = '''
import os as _os, sys as _sys
import numpy as np
_OUT = {}
def emit(name, value):
    value = np.asarray(value)
    if value.dtype.type.__module__.startswith("ml_dtypes"):  # npz cannot store these
        _OUT[name + "::dtype"] = np.asarray(str(value.dtype))
        value = value.view(f"u{value.dtype.itemsize}")
    _OUT[name] = value
'''

EPILOGUE = '''
np.savez(_os.environ["ISTHMUS_TEST_OUT"], **_OUT)
'''

LOCAL_ENV = {"JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def run_snippet(code: str, address: str | None, timeout: float = 180.0,
                env: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Runs a snippet (in `env`, default this process's environment); returns what it
    emitted. Raises with its output if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.npz")
        env = dict(os.environ if env is None else env)
        env.pop("XLA_FLAGS", None)
        env.pop("JAX_PLATFORMS", None)
        env["ISTHMUS_TEST_OUT"] = out
        if address is None:
            env.update(LOCAL_ENV)
        script = PRELUDE + textwrap.dedent(code) + EPILOGUE
        result = run_python(script, address, timeout=timeout, env=env)
        where = "through isthmus" if address else "on local jax"
        if result.returncode != 0:
            raise AssertionError(
                f"snippet failed {where} (exit {result.returncode}):\n"
                f"--- stdout ---\n{result.stdout[-5000:]}\n--- stderr ---\n"
                f"{result.stderr[-8000:]}")
        with np.load(out, allow_pickle=True) as data:
            return {k: data[k] for k in data.files}


# Local jax's results of the snippets run so far (the same snippet is compared on each of
# the suite's backends: its local run is the same process start, import and compile again).
_LOCAL: dict[str, dict[str, np.ndarray]] = {}


def local_results(code: str) -> dict[str, np.ndarray]:
    """What `code` emits on local jax; run once per test process."""
    if code not in _LOCAL:
        _LOCAL[code] = run_snippet(code, None)
    return _LOCAL[code]


def compare(code: str, address: str, *, rtol: float = 0.0, atol: float = 0.0
            ) -> dict[str, np.ndarray]:
    """Runs `code` through isthmus and locally; asserts equal results; returns them."""
    remote = run_snippet(code, address)
    local = local_results(code)
    assert sorted(remote) == sorted(local), (sorted(remote), sorted(local))
    assert remote, "the snippet emitted nothing: a test that cannot fail"
    for key in local:
        got, want = remote[key], local[key]  # through isthmus, and in local jax
        assert got.dtype == want.dtype, (
            f"{key}: dtype {got.dtype} through isthmus, {want.dtype} locally")
        assert got.shape == want.shape, (
            f"{key}: shape {got.shape} through isthmus, {want.shape} locally")
        if (rtol or atol) and got.dtype.kind in "fc":
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=key)
        elif got.dtype == object or got.dtype.kind in "USV":
            assert got.tolist() == want.tolist(), key
        else:
            assert got.tobytes() == want.tobytes() or np.array_equal(got, want, equal_nan=True), (
                f"{key} differs:\nisthmus: {got}\nlocal:   {want}")
    return remote
