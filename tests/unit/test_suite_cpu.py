"""tools/suite_cpu.py: the per-test CPU plugin's report, and the machine's busy time it reads."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "suite_cpu.py"


def _tool():
    spec = importlib.util.spec_from_file_location("suite_cpu", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_time_grows_with_work():
    tool = _tool()
    before = tool.busy_seconds()
    sum(i * i for i in range(3_000_000))
    assert tool.busy_seconds() > before


def test_the_report_sums_by_file_and_lists_the_costliest_tests(tmp_path):
    rows = [["tests/a.py::x", 2.0, 3.0], ["tests/a.py::y", 1.0, 1.0], ["tests/b.py::z", 4.0, 9.0]]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(rows))
    out = subprocess.run([sys.executable, str(TOOL), "report", str(path), "--top", "2"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines()[0] == "3 tests: 7 s, 13 CPU-s (1.86 cores on average)"
    files = [line.split() for line in out.split("file\n")[1].split("\n\n")[0].splitlines()]
    assert files == [["9.0", "4.0", "1", "tests/b.py"], ["4.0", "3.0", "2", "tests/a.py"]]
    assert out.rstrip().splitlines()[-2:] == ["    9.0      4.0  tests/b.py::z",
                                              "    3.0      2.0  tests/a.py::x"]
