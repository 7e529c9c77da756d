"""The honest peer of a fleet: multi-controller JAX on the same processes and devices.

`run_peer("dp_loop.py", processes=2, devices_per_process=4)` starts that many plain JAX
processes on this machine, joined by `jax.distributed` (a coordinator on a free port of
127.0.0.1, XLA:CPU collectives over gloo), each with its own CPU devices, all running the
script's twin mode (ISTHMUS_BENCH_PEER=COORDINATOR,PROCESSES,PROCESS_ID), and returns the
JSON that process 0 prints. Every process is killed if one fails or the run outlives its
timeout.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from isthmus.ports import free_port

HERE = pathlib.Path(__file__).parent



def peer_environment(base: dict[str, str], coordinator: str, processes: int, process_id: int,
                     devices_per_process: int) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in ("JAX_BACKEND_TARGET", "XLA_FLAGS")}
    env.update({"JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
                "ISTHMUS_BENCH_PEER": f"{coordinator},{processes},{process_id}"})
    return env


def run_peer(script: str, processes: int, devices_per_process: int, args: list[str],
             base: dict[str, str] | None = None, timeout: float = 900.0) -> dict:
    """Process 0's JSON of `script` run as a multi-controller job (module docstring)."""
    coordinator = f"127.0.0.1:{free_port()}"
    base = dict(os.environ if base is None else base)
    children: list[tuple[subprocess.Popen[str], tempfile._TemporaryFileWrapper[str]]] = []
    try:
        for process_id in range(processes):
            log = tempfile.NamedTemporaryFile(prefix=f"isthmus-peer-{process_id}-",
                                              suffix=".log", mode="w+")
            child = subprocess.Popen(
                [sys.executable, str(HERE / script), *args], text=True, stderr=log,
                stdout=subprocess.PIPE if process_id == 0 else subprocess.DEVNULL,
                env=peer_environment(base, coordinator, processes, process_id,
                                     devices_per_process),
                start_new_session=True)
            children.append((child, log))
        deadline = time.monotonic() + timeout
        while any(c.poll() is None for c, _ in children):
            failed = [(i, c) for i, (c, _) in enumerate(children)
                      if c.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = (f"process {failed[0][0]} exited with {failed[0][1].returncode}"
                       if failed else f"the job outlived {timeout:.0f} s")
                raise RuntimeError(f"the multi-controller {script} failed: {why}\n"
                                   + _tails(children))
            time.sleep(0.05)
        if any(c.returncode for c, _ in children):
            raise RuntimeError(f"the multi-controller {script} failed:\n" + _tails(children))
        first = children[0][0]
        assert first.stdout is not None
        return json.loads(first.stdout.read().strip().splitlines()[-1])
    finally:
        for child, log in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            if child.stdout is not None:
                child.stdout.close()
            log.close()


def _tails(children: list) -> str:
    tails = []
    for index, (_, log) in enumerate(children):
        log.seek(0)
        tails.append(f"--- process {index}:\n{log.read()[-2000:]}")
    return "\n".join(tails)


if __name__ == "__main__":
    print(json.dumps(run_peer("dp_loop.py", 2, 4, sys.argv[1:])))
