"""Only the shared service's own workers join its pool (issue 38, item 1).

The operator's documented command (`--tenants`, `--host 0.0.0.0`, no fleet token) once let any
process that reached the port join as a new slice, be granted to a tenant and receive her
arrays. Now the service makes a fleet token of its own and hands each worker it launches a
single-use join token; a stranger's worker, or one that replays a launched worker's token
(read from its environment, as a tenant's code could), is refused, the pool does not change,
and tenants' jobs go on. A service whose workers start elsewhere without a token or mutual TLS
is refused at start.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from isthmus import shared
from isthmus.testing import LocalServer, run_isthmus, run_python
from tests.integration.shared_service import EXPECTED, JOB, SharedService, result_of

pytestmark = pytest.mark.one_environment  # the server's own code: one environment runs it

BASE_ENV = {k: v for k, v in os.environ.items() if k != "ISTHMUS_FLEET_TOKEN"}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with SharedService(tmp_path_factory.mktemp("tenants"), (2, 1, 2),
                       {"alice": {"max_slices": 2}}, env=BASE_ENV,
                       args=["--host", "0.0.0.0", "--log-format", "json"]) as server:
        server.local = f"127.0.0.1:{server.address.rsplit(':', 1)[1]}"
        yield server


def _worker(address: str, env: dict[str, str], slice_index: int) -> subprocess.CompletedProcess:
    return run_isthmus(["worker", "--controller", address, "--slice", str(slice_index),
                        "--devices", "2", "--connect-timeout", "20"], env=env, timeout=90)


def _pool(server: LocalServer) -> list[int]:
    return sorted({d["slice"] for d in server.status()["devices"]})


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = f.read().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def test_a_strangers_worker_is_refused_and_the_pool_does_not_change(service):
    assert _pool(service) == [0, 1]
    stranger = _worker(service.local, BASE_ENV, 2)
    assert stranger.returncode == 2, stranger.stderr[-2000:]
    assert "refused this worker" in stranger.stderr
    again = _worker(service.local, BASE_ENV, 2)
    assert again.returncode == 2, again.stderr[-2000:]
    assert _pool(service) == [0, 1]
    log = service.log()
    # Logged once for its host, however often it knocks.
    assert log.count("refused a worker stream from 127.0.0.1") == 1, log[-3000:]
    with shared.lease(service.local, slices=2, token_file=service.tokens["alice"],
                      ca=service.ca, report=lambda line: None) as grant:
        result = run_python(JOB, grant.target, timeout=180)
    assert result_of(result) == pytest.approx(EXPECTED)


def test_a_launched_workers_token_opens_nothing_once_it_joined(service):
    """What a tenant's code could read in a worker (its environment) is used up."""
    pid = service.worker_pids(0)[0]
    environment = _environ(pid)
    token = environment.get("ISTHMUS_FLEET_TOKEN", "")
    assert token.startswith("isthmus-join:"), sorted(environment)
    replay = _worker(service.local, {**BASE_ENV, "ISTHMUS_FLEET_TOKEN": token}, 2)
    assert replay.returncode == 2, replay.stderr[-2000:]
    assert "refused this worker" in replay.stderr
    assert _pool(service) == [0, 1]
    assert service.alive()


# Slow (a worker's restart): test_shared.py's lost worker comes back to a --tenants service,
# as only a worker with a fresh join token can, in the default suite.
@pytest.mark.slow
def test_a_restarted_worker_joins_with_a_fresh_token(service):
    before = service.worker_pids(1)[0]
    service.kill_worker(1)
    service.wait_status(lambda s: s["shared"]["capacity_free"] == 2
                        and service.worker_pids(1) not in ([], [before]),
                        90, "slice 1's worker to be restarted, join again and be free")
    with shared.lease(service.local, slices=2, token_file=service.tokens["alice"],
                      ca=service.ca, report=lambda line: None) as grant:
        result = run_python(JOB, grant.target, timeout=180)
    assert result_of(result) == pytest.approx(EXPECTED)
    np.testing.assert_equal(_pool(service), [0, 1])


def test_workers_started_elsewhere_need_a_token_or_mutual_tls(tmp_path):
    (tmp_path / "a.token").write_text("a-secret\n")
    (tmp_path / "tenants.toml").write_text(
        '[tenants.a]\ntoken_file = "a.token"\nmax_slices = 1\n')
    result = run_isthmus(
        ["up", "--tenants", str(tmp_path / "tenants.toml"), "--host", "0.0.0.0", "--port", "0",
         "--no-launch", "--slices", "1"], env=BASE_ENV, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "admits only the fleet's own workers" in lines[0], lines
    assert "--token-file" in lines[0] and "--tls-cert" in lines[0]
