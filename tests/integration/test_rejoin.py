"""A worker started by hand survives its controller's crash: its supervisor starts it again,
it waits for a controller at the same address, joins the new one, and the fleet computes
again (compared with numpy); a controller stopped on purpose tells it to leave."""

import os
import selectors
import signal
import subprocess
import sys
import time

from isthmus.ports import free_port
from isthmus.serve import READY_PREFIX
from isthmus.testing import run_python

CLIENT = """
import jax, jax.numpy as jnp, numpy as np
np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x * 2 + 1)(jnp.arange(5))),
                              np.arange(5) * 2 + 1)
print("OK")
"""



def controller(port):
    return subprocess.Popen(
        [sys.executable, "-m", "isthmus.cli", "up", "--no-launch", "--port", str(port),
         "--slices", "1", "--hosts-per-slice", "1", "--devices-per-host", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def wait_ready(process, timeout=120.0):
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the controller exited"
        if selector.select(timeout=0.5):
            line = process.stdout.readline()
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].strip()
    raise AssertionError("the controller never became ready")


def test_a_worker_rejoins_a_controller_that_crashed(tmp_path):
    port = free_port()
    first = controller(port)
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "isthmus.cli", "worker", "--controller", f"127.0.0.1:{port}",
         "--devices", "2", "--connect-timeout", "120"], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    second = None
    try:
        address = wait_ready(first)
        assert "OK" in run_python(CLIENT, address, timeout=120).stdout
        os.killpg(first.pid, signal.SIGKILL)  # a crash: no goodbye to the worker
        first.wait(30)
        second = controller(port)
        address = wait_ready(second)  # the worker has joined the new controller
        result = run_python(CLIENT, address, timeout=120)
        assert "OK" in result.stdout, result.stdout + result.stderr[-3000:]
        assert worker.poll() is None
        second.send_signal(signal.SIGTERM)  # stopped on purpose: the worker leaves
        assert worker.wait(60) == 0
    finally:
        for process in (first, second, worker):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "worker.log").read_text()
    assert "starting it again" in text and "rejoin a controller at the same address" in text
