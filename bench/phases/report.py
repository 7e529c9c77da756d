"""What bench/phases/sitecustomize.py wrote, read back.

    python bench/phases/report.py DIR                     each process: its phases
    python bench/phases/report.py DIR --requests        where a round trip goes: the median
        time from each event to the next (requests handled, responses sent, frames written),
        over the server's last 3,000 of them (ISTHMUS_PHASES_REQUESTS=1)
    python bench/phases/report.py DIR --windows SIZES [--threads OUT]
        the slowest windows of each size (SIZES: windows.py's output), with what the server
        did in them, and with --threads each of its threads' CPU in them and the states and
        system calls its main thread was seen in (threads.py's OUT)
"""

import collections
import glob
import json
import statistics
import sys


def phases(folder: str) -> None:
    for path in sorted(glob.glob(f"{folder}/*-*.json")):
        if path.endswith(".events.json"):
            continue
        with open(path) as f:
            d = json.load(f)
        print(f"== {path}: wall {d['wall']:.2f} s, main thread's CPU {d['main_cpu']:.2f} s, "
              f"process CPU {d['proc_cpu']:.2f} s")
        for name, (count, total, top) in sorted(d["times"].items(), key=lambda kv: -kv[1][1]):
            mean = total / count * 1e6
            print(f"  {name:22} n={count:8d} total={total:8.3f} s mean={mean:8.1f} us "
                  f"max={top * 1e3:8.2f} ms buckets={d['hist'][name]}")


def _threads_cpu(samples: list[dict], begin: float, end: float) -> list[tuple[str, float]]:
    """Each thread's CPU ms between two times, from bench/phases/threads.py's samples."""
    before = [s for s in samples if s["t"] <= begin and "cpu" in s]
    after = [s for s in samples if s["t"] >= end and "cpu" in s]
    if not before or not after:
        return []
    a, b = before[-1]["cpu"], after[0]["cpu"]
    spent = [(name, (b[name] - a.get(name, 0.0)) / 1e6) for name in b]
    return sorted((x for x in spent if x[1] > 0), key=lambda x: -x[1])


def _rss(samples: list[dict], begin: float, end: float) -> tuple[int, int] | None:
    """The process's resident KiB at the last sample before a window and the first after."""
    before = [s["rss_kib"] for s in samples if s["t"] <= begin and s.get("rss_kib")]
    after = [s["rss_kib"] for s in samples if s["t"] >= end and s.get("rss_kib")]
    return (before[-1], after[0]) if before and after else None


def _main_states(samples: list[dict], begin: float, end: float) -> collections.Counter:
    """How often the main thread was seen in each (state, system call) between two times."""
    return collections.Counter(" ".join(s["main"]).strip() for s in samples
                               if "main" in s and begin <= s["t"] <= end)


def slowest_windows(folder: str, sizes_path: str, shown: int = 3,
                    threads_path: str | None = None) -> None:
    with open(sizes_path) as f:
        runs = [json.loads(line) for line in f if line.startswith('{"n"')]
    events = []
    for path in glob.glob(f"{folder}/server-*.events.json"):
        with open(path) as f:
            events.extend(json.load(f))
    samples = []
    if threads_path:
        with open(threads_path) as f:
            samples = [json.loads(line) for line in f if line.strip()]
    for run in runs:
        times = run["windows"]
        spans = [times[i + 1][0] - times[i][0] for i in range(len(times) - 1)]
        print(f"n={run['n']} ms/step={run['ms']:.3f} windows={len(times)} median window "
              f"{statistics.median(spans) * 1e3:.1f} ms")
        for i in sorted(range(len(spans)), key=lambda i: -spans[i])[:shown]:
            began, dispatched, waited = times[i]
            inside = [e for e in events if began <= e[0] <= times[i + 1][0] + 0.001]
            calls = collections.Counter(e[1] for e in inside if e[1] != "stack")
            stacks = collections.Counter(e[2] for e in inside if e[1] == "stack")
            long = [(round((e[0] - began) * 1e3, 1), e[1], e[2]) for e in inside
                    if e[1] != "stack" and (e[2] > 1500 or e[1].startswith("gc"))]
            print(f"  window {i}: {spans[i] * 1e3:.1f} ms (dispatch "
                  f"{(dispatched - began) * 1e3:.1f}, wait {(waited - dispatched) * 1e3:.1f}); "
                  f"server calls {dict(calls)}; long ones (ms in, name, us) {long[:12]}; "
                  f"stack samples {sum(stacks.values())}")
            for stack, count in stacks.most_common(3):
                print(f"      {count:4d} x {stack[:300]}")
            if samples:
                spent = _threads_cpu(samples, began, times[i + 1][0])
                print(f"      threads' CPU in it, ms: {sum(ms for _, ms in spent):.1f} in all; "
                      + ", ".join(f"{name} {ms:.1f}" for name, ms in spent[:6]))
                rss = _rss(samples, began, times[i + 1][0])
                if rss is not None:
                    print(f"      resident memory: {rss[0] / 1024:.0f} -> {rss[1] / 1024:.0f} MiB")
                seen = _main_states(samples, began, times[i + 1][0])
                print("      its main thread seen: " + ", ".join(
                    f"{what or '?'} x{count}" for what, count in seen.most_common(6)))


def round_trips(folder: str, last: int = 3000) -> None:
    """The median gap between each pair of successive request events of the server (`req:`,
    `sent:`, `flush`), the most frequent pairs first: a loop's cycle, step by step."""
    events = []
    for path in glob.glob(f"{folder}/server-*.events.json"):
        with open(path) as f:
            events.extend(e for e in json.load(f)
                          if e[1] == "flush" or e[1].startswith(("req:", "sent:")))
    events.sort()
    events = events[-last:]
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for (t0, a, _), (t1, b, _) in zip(events, events[1:]):
        gaps[(a, b)].append((t1 - t0) * 1e3)
    for (a, b), ms in sorted(gaps.items(), key=lambda kv: -len(kv[1]))[:14]:
        print(f"  {a[:44]:44} -> {b[:44]:44} n={len(ms):5d} median {statistics.median(ms):.3f} ms")


if __name__ == "__main__":
    if "--requests" in sys.argv:
        round_trips(sys.argv[1])
        sys.exit(0)
    if "--windows" in sys.argv:
        threads = (sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv
                   else None)
        slowest_windows(sys.argv[1], sys.argv[sys.argv.index("--windows") + 1],
                        threads_path=threads)
    else:
        phases(sys.argv[1])
