"""Each thread's CPU in a process, sampled from outside it every few milliseconds.

    python bench/phases/threads.py PID OUT [INTERVAL_MS]

Writes one JSON line per sample to OUT, `{"t": wall clock, "cpu": {"TID name": ns}}`, until
the process ends. Read from /proc (each task's `schedstat` where the kernel has it, else its
`stat` in clock ticks), with no help from the process: it goes on while the process's Python
is held up, and shows which thread spent the CPU then, or that none did (the process was
stopped, or waited in the kernel). bench/phases/report.py --windows reads it beside the
phase timer's events; windows.py starts it on its server with `--threads OUT`.
"""

import json
import os
import sys
import time

TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def _cpu_ns(task: str) -> float | None:
    try:
        with open(f"{task}/schedstat") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * TICK_NS  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def sample(pid: int) -> dict[str, float]:
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        task = f"{base}/{tid}"
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        ns = _cpu_ns(task)
        if ns is not None:
            out[f"{tid} {name}"] = ns
    return out


def main() -> None:
    pid, path = int(sys.argv[1]), sys.argv[2]
    interval = float(sys.argv[3]) / 1e3 if len(sys.argv) > 3 else 0.005
    with open(path, "w") as f:
        while True:
            try:
                cpu = sample(pid)
            except OSError:  # the process has ended
                return
            f.write(json.dumps({"t": round(time.time(), 6), "cpu": cpu}) + "\n")
            time.sleep(interval)


if __name__ == "__main__":
    main()
