"""The processes of the shared-service benchmarks (`bench/shared.py`, `bench/shared_floods.py`).

A shared server on a local fleet (`service`); the tenants' client processes, which are this
file run as a script (`--queued`: a job waiting for its lease's target, `--loop`: a
dispatch-bound loop of tiny jitted programs), and `Child`, the driver's handle on one; and
the CPU time processes and the machine spend (Linux /proc). Only the standard library is
imported at the top: as a script, this file runs without the `bench` package on its path.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

WINDOW = 50  # programs per batch of the loop (pipelined, then waited for)
# A timed window of the loop: longer than the kernel's time slice, so that sharing the cores
# with the other tenants shows in each window (not only between them).
WINDOW_SECONDS = 0.1


# ---- the client processes (this file as a script) ------------------------------------------


def queued_child() -> None:
    """The queued job: imports first, then waits for its lease's target on stdin."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax
    import numpy as np

    from isthmus._bootstrap.jax_plugins import isthmus_proxy  # noqa: F401 (imported early)
    from isthmus.client import connect

    scale = float(sys.argv[2])  # a program of its own each time: compiled cold
    print("READY", flush=True)
    target = sys.stdin.readline().strip()
    got = time.monotonic()
    connect(target)
    jax.devices()
    connected = time.monotonic()
    value = float(jax.jit(lambda a: (a * scale + 1).sum())(np.arange(8.0, dtype=np.float32)))
    done = time.monotonic()
    print(json.dumps({"got": got, "connected": connected, "result": done, "value": value}),
          flush=True)


def loop_child() -> None:
    """A tenant's dispatch-bound loop: `go START SECONDS` runs from START (time.monotonic)
    for SECONDS, in windows of at least WINDOW_SECONDS (batches of WINDOW pipelined programs,
    then a wait), and answers the windows' median per-program time; `quit` ends. On the jax
    its environment names (a lease's, or local), on device $ISTHMUS_BENCH_DEVICE (0)."""
    import jax
    import numpy as np

    device = jax.devices()[int(os.environ.get("ISTHMUS_BENCH_DEVICE", "0"))]
    f = jax.jit(lambda a: a + 1)
    y = jax.device_put(np.float32(0), device)
    for _ in range(2 * WINDOW):
        y = f(y)
    done = 2 * WINDOW
    if float(y) != done:
        raise SystemExit(f"the loop's result is {float(y)}, not {done}")
    print("READY", os.getpid(), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "quit":
            break
        start, seconds = float(words[1]), float(words[2])
        time.sleep(max(0.0, start - time.monotonic()))
        windows, programs = [], 0
        while time.monotonic() < start + seconds:
            began, count = time.perf_counter(), 0
            while time.perf_counter() - began < WINDOW_SECONDS:
                for _ in range(WINDOW):
                    y = f(y)
                y.block_until_ready()
                count += WINDOW
            windows.append((time.perf_counter() - began) / count)
            programs += count
        done += programs
        print(json.dumps({"per_program_s": statistics.median(windows),
                          "programs": programs}), flush=True)
    if done < 1 << 24 and float(y) != done:  # float32 counts exactly up to 2**24
        raise SystemExit(f"the loop's result is {float(y)}, not {done}")


# ---- the driver's side -----------------------------------------------------------------------


def base_env() -> dict[str, str]:
    """This process's environment without what would point a child's jax elsewhere."""
    return {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}


class Child:
    """This file as a client process; its stdout lines arrive on a queue (a thread reads)."""

    def __init__(self, args: list[str], env: dict[str, str], prefix: tuple[str, ...] = ()
                 ) -> None:
        """Runs `python THIS_FILE args`, after `prefix` (`isthmus run --service ... --`)."""
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [*prefix, sys.executable, __file__, *args], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.tunnelled = bool(prefix)  # the process is `isthmus run`, with the loop under it
        self.pid = self.process.pid  # the loop's (from its READY line, when tunnelled)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def expect(self, prefix: str, timeout: float = 120.0) -> str:
        """The next stdout line that starts with `prefix`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"no {prefix!r} line from a client in {timeout} s:\n"
                                   f"{self.stderr()}") from None
            if line is None:
                self.process.wait(10)
                raise RuntimeError(f"a client ended ({self.process.returncode}) before its "
                                   f"{prefix!r} line:\n{self.stderr()}")
            if line.startswith(prefix):
                return line

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send("quit")
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


@contextlib.contextmanager
def service(fleet: tuple[int, int, int], tenants: dict[str, str], top: str = ""
            ) -> Iterator[dict[str, Any]]:
    """A shared server (`--tenants`, a self-signed TLS client port) on a local fleet of
    `fleet` (slices, hosts per slice, devices per host): a tenant per entry of `tenants`, with
    its token file and the settings of its table (`"max_slices = 1\\n"`); `top`: the tenants
    file's settings before the tables. Yields the server, the client port (`service`), the
    certificate (`ca`) and each tenant's token file (`tokens`)."""
    from isthmus.testing import LocalServer

    with tempfile.TemporaryDirectory(prefix="isthmus-bench-tenants-") as directory:
        folder = pathlib.Path(directory)
        tables = [top]
        for name, settings in tenants.items():
            (folder / f"{name}.token").write_text(f"{name}-bench-{os.getpid()}\n")
            tables.append(f'[tenants.{name}]\ntoken_file = "{name}.token"\n{settings}')
        (folder / "tenants.toml").write_text("\n".join(tables))
        with LocalServer(devices=None, fleet=fleet,
                         args=["--tenants", str(folder / "tenants.toml")]) as server:
            yield {"server": server, "service": server.address.removeprefix("grpc://"),
                   "ca": str(folder / "isthmus-service" / "service-cert.pem"),
                   "tokens": {name: str(folder / f"{name}.token") for name in tenants}}


def job_of(svc: dict[str, Any], who: str) -> tuple[str, ...]:
    """The command before a tenant's job, as users start one: `isthmus run --service` holds
    a 1-slice lease and its forwarder, and starts the job with its jax on the lease."""
    return (sys.executable, "-m", "isthmus.cli", "run", "--service", svc["service"],
            "--service-ca", svc["ca"], "--token-file", svc["tokens"][who], "--slices", "1",
            "--")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time all of the machine's cores spent busy since boot (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    if "--queued" in sys.argv:
        queued_child()
    elif "--loop" in sys.argv:
        loop_child()
