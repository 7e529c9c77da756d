"""scripts/gpu-check runs where there is no GPU too (`--platform cpu`), so that the command
GPU owners run by hand keeps working: the table, the JSON, and bit-identical training."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


# The slowest default test (72 s of 1287 s here): run with `scripts/test -m slow`, and on a
# lent GPU machine as scripts/gpu-check itself. CI's 20-minute budget.
@pytest.mark.slow
def test_gpu_check_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run(
        [os.path.join(ROOT, "scripts", "gpu-check"), "--platform", "cpu", "--json", str(out)],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bit-identical to local jax: isthmus embedded: yes, isthmus fleet 2x1: yes" in \
        result.stdout, result.stdout
    report = json.loads(out.read_text())
    assert report["all_identical"] and report["fleet_2_device_loss_rel_diff"] < 1e-5
    assert set(report["runs"]) == {"local jax", "isthmus embedded", "isthmus fleet 2x1"}
    for run in report["runs"].values():
        assert run["client"]["pipelined_calls_per_s"] > 0
        assert len(run["threshold"]["sizes"]) == 3
