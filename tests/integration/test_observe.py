"""The metrics port (`--metrics-port`): Prometheus text at /metrics, the live view's data
at /api/state and its page at /, on the embedded backend with programs run through it;
and (slow) on a fleet of worker processes: transfers between them, a worker lost and
restarted, and the page as headless Chromium renders it."""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile

import numpy as np
import pytest

from isthmus.testing import LocalServer, run_python
from tests.integration.scraping import families, get, metrics_url, scrape_when, value

pytestmark = pytest.mark.one_environment  # the server's own code: one environment runs it

CLIENT = """
import jax, jax.numpy as jnp, numpy as np
devices = jax.devices()
x = jax.device_put(np.arange(1024, dtype=np.float32), devices[0])  # a put of 4 KiB
step = jax.jit(lambda a: a * 2.0 + 1.0)
for _ in range(RUNS):
    x = step(x)
x.block_until_ready()
moved = jax.device_put(x, devices[-1])  # to the other slice: worker to worker
print("RESULT", float(np.asarray(x).sum()), float(np.asarray(moved).sum()))
"""
RUNS = 5




def expected_sum(runs: int) -> float:
    expected = np.arange(1024, dtype=np.float32)
    for _ in range(runs):
        expected = expected * 2.0 + 1.0
    return float(expected.sum())


def run_client(server: LocalServer, runs: int) -> None:
    result = run_python(CLIENT.replace("RUNS", str(runs)), server.address)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    assert [float(v) for v in line.split()[1:]] == [expected_sum(runs)] * 2


@pytest.fixture(scope="module")
def observed():
    """The embedded backend (2 devices) with metrics on, after one client ran."""
    with LocalServer(devices=2, args=["--metrics-port", "0"]) as server:
        base = metrics_url(server)
        run_client(server, RUNS)
        yield server, base
        assert server.alive(), server.log()





def test_metrics_count_what_the_client_did(observed):
    _, base = observed
    # The client's session closes as the server sees its stream end.
    found = scrape_when(base, lambda f: value(f["isthmus_sessions"]) == 0,
                        "the client's session did not close")
    for name in ("isthmus_programs_executed", "isthmus_program_seconds",
                 "isthmus_transfer_bytes", "isthmus_workers_up", "isthmus_slices_up",
                 "isthmus_sessions", "isthmus_worker_losses", "isthmus_device_memory_bytes",
                 "isthmus_event_loop_lag_seconds", "isthmus_dispatch_queue_depth",
                 "isthmus_compile_cache_hits", "isthmus_compile_cache_misses",
                 "isthmus_worker_restarts"):
        assert name in found, f"{name} missing from {sorted(found)}"
    assert "isthmus_shared_leases" not in found  # only a shared service has leases
    programs = found["isthmus_programs_executed"]
    assert {s.labels["slice"] for s in programs.samples} == {"0"}
    assert value(programs, slice="0") >= RUNS
    assert value(found["isthmus_transfer_bytes"], direction="put") >= 1024 * 4
    assert value(found["isthmus_transfer_bytes"], direction="fetch") >= 2 * 1024 * 4
    assert value(found["isthmus_transfer_bytes"], direction="peer") == 0  # one process
    assert value(found["isthmus_workers_up"]) == 1
    assert value(found["isthmus_slices_up"]) == 1
    assert value(found["isthmus_worker_losses"]) == 0
    assert value(found["isthmus_compile_cache_misses"]) >= 1
    histogram = {s.name: s for s in found["isthmus_program_seconds"].samples}
    # block_until_ready and the fetches waited for the last step's output.
    assert histogram["isthmus_program_seconds_count"].value >= 1
    assert 0 < histogram["isthmus_program_seconds_sum"].value < 60
    assert value(found["isthmus_event_loop_lag_seconds"]) < 5


def state(base: str) -> dict:
    status, content_type, body = get(base + "/api/state")
    assert status == 200 and content_type == "application/json"
    return json.loads(body)


def test_state_has_the_fleet_and_its_events(observed):
    server, base = observed
    now = state(base)
    assert [s["index"] for s in now["slices"]] == [0]
    [host] = now["slices"][0]["hosts"]
    assert host["state"] == "up" and host["pid"] == server.process.pid
    assert [d["id"] for d in host["devices"]] == [0, 1]
    assert now["counters"]["programs"] >= RUNS
    assert now["gauges"]["workers_up"] == 1
    compiled = [e for e in now["events"] if e["kind"] == "compiled"]
    assert compiled and "jit__lambda" in compiled[0]["fields"]["program"], now["events"]


def test_page_and_what_is_refused(observed):
    _, base = observed
    status, content_type, body = get(base + "/")
    assert status == 200 and content_type.startswith("text/html")
    assert b"api/state" in body
    assert get(base + "/nothing")[0] == 404
    port = int(base.rsplit(":", 1)[1])

    def ask(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(request)
            return s.recv(4096)

    assert ask(b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").startswith(
        b"HTTP/1.1 405")
    # A page elsewhere reaching the port by a DNS name that points here is refused.
    assert ask(b"GET /api/state HTTP/1.1\r\nHost: evil.example:80\r\n\r\n").startswith(
        b"HTTP/1.1 403")
    assert ask(b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="isthmus-chromium-") as profile:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
             *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fleet():
    """A fleet of 2 slices x 2 hosts x 2 devices with metrics on, after one client ran."""
    with LocalServer(devices=None, fleet=(2, 2, 2), args=["--metrics-port", "0"]) as server:
        base = metrics_url(server)
        run_client(server, 50)
        yield server, base
        assert server.alive(), server.log()


@pytest.mark.slow
def test_a_fleet_s_transfers_losses_and_restarts(fleet):
    server, base = fleet
    found = families(base)
    assert value(found["isthmus_transfer_bytes"], direction="peer") >= 1024 * 4
    assert value(found["isthmus_workers_up"]) == 4
    assert value(found["isthmus_slices_up"]) == 2
    assert {s.labels["slice"] for s in found["isthmus_programs_executed"].samples} == {"0", "1"}
    assert value(found["isthmus_programs_executed"], slice="0") >= 50
    kinds = [e["kind"] for e in state(base)["events"]]
    assert kinds.count("worker_joined") == 4 and "group_formed" in kinds, kinds

    server.kill_worker(1)
    found = scrape_when(base, lambda f: value(f["isthmus_worker_losses"]) >= 1
                        and value(f["isthmus_worker_restarts"]) >= 1,
                        "the lost worker was not counted and restarted", timeout=60)
    down = state(base)
    # The slice comes back once the restarted worker is in the group again.
    found = scrape_when(base, lambda f: value(f["isthmus_slices_up"]) == 2
                        and value(f["isthmus_workers_up"]) == 4,
                        "slice 1 did not come back", timeout=120)
    kinds = [e["kind"] for e in state(base)["events"]]
    for kind in ("worker_lost", "worker_restarting", "worker_restarted"):
        assert kind in kinds, kinds
    assert value(found["isthmus_group_generation"]) >= 2
    assert down["counters"]["worker_losses"] >= 1


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_the_view_renders_the_fleet_in_chromium(fleet, tmp_path):
    """The page, as a browser runs it, shows every slice, host and device, the programs
    and the events. $ISTHMUS_VIEW_SCREENSHOT names a PNG to keep (docs/observability-view.png
    is made this way)."""
    server, base = fleet
    run_client(server, 20)  # some traffic in the last seconds
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", base + "/")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert '<span id="conn">live</span>' in dom.stdout, dom.stdout[:3000]
    text = re.sub(r"<[^>]+>", " ", dom.stdout.split("<script>")[0])
    for s in (0, 1):
        assert f"slice {s}" in text, text[:3000]
    for d in range(8):
        assert f"device {d}" in text, text[:3000]
    assert "4 / 4" in text  # workers up / slots
    assert "worker_joined" in text and "group_formed" in text
    shot = os.environ.get("ISTHMUS_VIEW_SCREENSHOT") or str(tmp_path / "view.png")
    picture = chromium("--virtual-time-budget=5000", "--window-size=1200,1400",
                       "--hide-scrollbars", f"--screenshot={shot}", base + "/")
    assert picture.returncode == 0, picture.stderr[-3000:]
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
