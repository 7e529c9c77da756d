"""Each thread's CPU in a process, and what its main thread is doing, sampled from outside it.

    python bench/phases/threads.py PID OUT [INTERVAL_MS]

Writes JSON lines to OUT until the process ends, read from /proc with no help from the
process: they go on while the process's Python is held up.

- every INTERVAL_MS (5), the main thread's scheduler state and, where the kernel tells it,
  the system call it is in: `{"t": wall clock, "main": ["S", "futex"]}` (R running, S
  sleeping, D in the kernel uninterruptibly; the call's name, its number where this table
  lacks it, "running" in user space, "" where /proc has no `syscall`);
- every 20th of those, each thread's CPU and the process's resident memory: `{"t": ...,
  "cpu": {"TID name": ns}, "rss_kib": VmRSS}` (each task's `schedstat` where the kernel has
  it, else its `stat` in clock ticks). Reading every
  thread of a server with a TPU client took 100-150 ms a sample on the v5e sandbox, too
  slow to see inside a 200 ms stop; the main thread's two files take far less.

Where the main thread is asleep in `futex` through a stop, it waits for a lock: the GIL
held by another thread, or one of the runtime's own. bench/phases/report.py --windows reads
both beside the phase timer's events; windows.py starts this on its server with
`--threads OUT`.
"""

import json
import os
import sys
import time

TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")
FULL_EVERY = 20  # main-thread samples per sample of every thread's CPU
# x86-64 system call numbers a blocked Python thread is usually in.
SYSCALLS = {0: "read", 1: "write", 7: "poll", 9: "mmap", 10: "mprotect", 11: "munmap",
            12: "brk", 16: "ioctl", 23: "select", 24: "sched_yield", 25: "mremap",
            28: "madvise", 35: "nanosleep", 44: "sendto", 45: "recvfrom", 46: "sendmsg",
            47: "recvmsg", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
            270: "pselect6", 271: "ppoll", 281: "epoll_pwait"}


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


def rss_kib(pid: int) -> int | None:
    """The process's resident memory (VmRSS), KiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def main_thread(pid: int) -> list[str]:
    """The main thread's state and system call (see the module's docstring). Raises
    OSError once the process has ended."""
    task = f"/proc/{pid}/task/{pid}"
    with open(f"{task}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    if state in ("Z", "X"):  # ended, not yet reaped by its parent
        raise OSError(f"process {pid} has ended")
    try:
        with open(f"{task}/syscall") as f:
            first = f.read().split()
    except OSError:
        return [state, ""]
    if not first:
        return [state, ""]
    if not first[0].lstrip("-").isdigit():
        return [state, first[0]]  # "running"
    number = int(first[0])
    return [state, SYSCALLS.get(number, str(number))]


def main() -> None:
    pid, path = int(sys.argv[1]), sys.argv[2]
    interval = float(sys.argv[3]) / 1e3 if len(sys.argv) > 3 else 0.005
    with open(path, "w") as f:
        count = 0
        while True:
            try:
                line = {"t": round(time.time(), 6), "main": main_thread(pid)}
                if count % FULL_EVERY == 0:
                    line["cpu"] = sample(pid)
                    line["rss_kib"] = rss_kib(pid)
            except OSError:  # the process has ended
                return
            f.write(json.dumps(line) + "\n")
            count += 1
            time.sleep(interval)


if __name__ == "__main__":
    main()
