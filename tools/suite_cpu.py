"""Where a test run's time and CPU go, test by test: a pytest plugin, and its report.

    PYTHONPATH=tools ISTHMUS_TEST_ENV=oldest .venv/bin/python -m pytest -p suite_cpu tests
    python tools/suite_cpu.py report .suite_cpu.json [--top 25]

For each test (setup, call and teardown together) the plugin records its wall time and the
CPU the whole machine spent meanwhile (busy time from /proc/stat): the servers, workers,
vetting processes and clients a test starts run in other processes, many in sessions of
their own, so the machine's count is the one that sees them all. It is only meaningful with
one pytest process and nothing else running; the file is SUITE_CPU_OUT (default
.suite_cpu.json). The report sums by file and lists the costliest tests.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Iterator
from typing import Any

_rows: list[tuple[str, float, float]] = []


def busy_seconds() -> float:
    """CPU-seconds the machine has spent busy (all cores) since it started."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


try:
    import pytest
except ImportError:  # the report alone needs no pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
        busy, began = busy_seconds(), time.monotonic()
        yield
        _rows.append((item.nodeid, time.monotonic() - began, busy_seconds() - busy))

    def pytest_sessionfinish(session: Any) -> None:
        with open(os.environ.get("SUITE_CPU_OUT", ".suite_cpu.json"), "w") as f:
            json.dump(_rows, f)


def report(path: str, top: int) -> None:
    with open(path) as f:
        rows = json.load(f)
    wall = sum(r[1] for r in rows)
    cpu = sum(r[2] for r in rows)
    print(f"{len(rows)} tests: {wall:.0f} s, {cpu:.0f} CPU-s ({cpu / max(wall, 1e-9):.2f} "
          "cores on average)")
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for node, seconds, busy in rows:
        entry = files[node.split("::")[0]]
        entry[0] += seconds
        entry[1] += busy
        entry[2] += 1
    print("\n  CPU-s   wall s  tests  file")
    for name, (seconds, busy, count) in sorted(files.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{busy:7.1f} {seconds:8.1f} {int(count):6d}  {name}")
    print("\n  CPU-s   wall s  test")
    for node, seconds, busy in sorted(rows, key=lambda r: -r[2])[:top]:
        print(f"{busy:7.1f} {seconds:8.1f}  {node}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    shown = commands.add_parser("report", help="sum a run's file by test file and test")
    shown.add_argument("path", nargs="?", default=".suite_cpu.json")
    shown.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    report(args.path, args.top)


if __name__ == "__main__":
    main()
