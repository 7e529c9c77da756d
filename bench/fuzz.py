"""The protocol fuzzer as a load: python -m bench.fuzz [--requests N] [--fleet-requests N].

Runs the fuzzer of `tests/integration/fuzzer.py` (valid handles, well-formed and mutated
requests, three sessions, sessions churned) against an embedded server (4 devices) and a
local fleet (2 slices x 1 host x 2 devices), and prints per backend the sustained request
rate and the resident memory (VmRSS) of the server and of each worker at the start (a tenth
into the run, once programs are compiled), the middle and the end of the run: a server that
leaks per request or per session shows it there. Findings are listed too (a run stops early
when a process dies).

No figure here is a test assertion; `tests/integration/test_fuzz.py` asserts what must hold.
"""

from __future__ import annotations

import argparse
import time

from bench.elastic import rss_mib
from isthmus.testing import LocalServer
from tests.integration.fuzzer import Fuzzer, Summary

# Validate mode: a request that leaves the controller's records inconsistent is a finding
# (it fails with INTERNAL, which the fuzzer reports, and the server's log names it).
ARGS = ["--host-buffer-timeout", "2", "--validate"]


def run(server: LocalServer, requests: int, seed: int, exclude: list[str]
        ) -> tuple[Summary, dict[str, list[float]], list[float]]:
    """Fuzzes `requests` requests; returns the summary, RSS per process at start (a tenth
    in), middle and end, and the request rate from start to middle and middle to end."""
    processes = {"server": server.process.pid}  # type: ignore[union-attr]
    if server.fleet is not None:
        for slice_index in range(server.fleet[0]):
            for host, pid in enumerate(server.worker_pids(slice_index)):
                processes[f"worker {slice_index}/{host}"] = pid
    fuzzer = Fuzzer(server.address, seed=seed, sessions=3, timeout=10.0,
                    pids=list(processes.values()), exclude=exclude)
    memory: dict[str, list[float]] = {name: [] for name in processes}
    marks: list[tuple[float, int]] = []
    calls = [0]

    def sample(f: Fuzzer) -> None:
        # "start" is after a tenth of the run (programs compiled, caches warm), "middle"
        # at half of it.
        calls[0] += 1
        if calls[0] in (1, 5):
            marks.append((time.monotonic(), f.sent))
            for name, pid in processes.items():
                memory[name].append(rss_mib(pid))

    fuzzer.on_progress = sample
    summary = fuzzer.run(requests=requests, progress_every=max(requests // 10, 1))
    marks.append((time.monotonic(), fuzzer.sent))
    for name, pid in processes.items():
        memory[name] += [float("nan")] * (2 - len(memory[name])) + [rss_mib(pid)]
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:]) if b[0] > a[0]]
    return summary, memory, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000,
                        help="requests against the embedded server")
    parser.add_argument("--fleet-requests", type=int, default=None,
                        help="requests against the fleet (default: a quarter of --requests)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--exclude", default="",
                        help="comma-separated episode-label prefixes to skip (e.g. a known "
                             "crash, to measure the rest)")
    args = parser.parse_args()
    exclude = [x for x in args.exclude.split(",") if x]
    backends = (("embedded (4 devices)", {"devices": 4}, args.requests),
                ("fleet 2x1x2", {"devices": None, "fleet": (2, 1, 2)},
                 args.fleet_requests or max(args.requests // 4, 100)))
    reports = []
    print(f"{'backend':22}{'requests':>10}{'req/s':>8}{'to mid':>10}{'to end':>10}"
          f"{'findings':>10}   {'process':14}{'RSS MiB start':>14}{'middle':>8}{'end':>8}")
    for name, shape, requests in backends:
        with LocalServer(args=ARGS, **shape) as server:
            summary, memory, rates = run(server, requests, args.seed, exclude)
        halves = [f"{r:10.0f}" for r in rates[:2]] + [f"{'':>10}"] * (2 - len(rates[:2]))
        first = True
        for process, (start, mid, end) in memory.items():
            lead = (f"{name:22}{summary.requests:10d}{summary.rate:8.0f}{''.join(halves)}"
                    f"{len(summary.findings):10d}" if first else " " * 70)
            print(f"{lead}   {process:14}{start:14.0f}{mid:8.0f}{end:8.0f}")
            first = False
        reports.append(f"{name}: {summary.report()}")
    print()
    for report in reports:
        print(report)


if __name__ == "__main__":
    main()
