"""A shared service on a 3-slice CPU fleet: leases, the queue, identities, isolation, grace.

The test process holds leases itself (`isthmus.shared.lease`: a forwarder and a lease
stream, no jax), and runs the stock jax client in subprocesses through the lease's tunnel;
`isthmus run --service` is driven as a user runs it. Every result is compared with numpy.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from isthmus import shared
from isthmus.testing import run_isthmus, run_python, run_python_with_pause, wait_until
from tests.integration.rawclient import RawSession, status_of
from tests.integration.shared_service import EXPECTED, JOB, SharedService, result_of

pytestmark = pytest.mark.one_environment  # the server's own code: one environment runs it

GRACE = 3.0
TENANTS = {"alice": {"max_slices": 2}, "bob": {"max_slices": 1, "priority": 5},
           "carol": {"max_slices": 3}, "ops": {"max_slices": 0}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    socket_path = directory / "service.sock"
    with SharedService(directory, (3, 1, 2), TENANTS,
                       {"admins": ["ops"], "grace_seconds": GRACE}, args=[
                           "--unix-socket", str(socket_path), "--allow-plain-connect",
                           "--log-format", "json"]) as server:
        server.unix = f"unix:{socket_path}"
        yield server


def resumed(service, who, name):
    """The lease `name` again, once the service saw its last client go (a few ms)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            context = service.lease(who, slices=1, name=name)
            grant = context.__enter__()
        except shared.LeaseRefused as e:
            if "in use by another client" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        break

    class Held:
        def __enter__(self):
            return grant

        def __exit__(self, *exc):
            return context.__exit__(*exc)
    return Held()


def figures(service):
    return service.status()["shared"]


def devices_of(result):
    line = next(line for line in result.stdout.splitlines() if line.startswith("DEVICES"))
    return line


def test_two_tenants_run_and_a_third_waits_its_turn(service):
    with service.lease("alice", slices=2) as a, service.lease("bob", slices=1) as b:
        assert sorted(a.slices + b.slices) == [0, 1, 2]
        ran_a = run_python(JOB, a.target)
        ran_b = run_python(JOB, b.target)
        assert result_of(ran_a) == EXPECTED and result_of(ran_b) == EXPECTED
        # Each sees its own slices' devices, numbered from slice 0.
        ids_a = {2 * s + i for s in a.slices for i in range(2)}
        ids_b = {2 * s + i for s in b.slices for i in range(2)}
        assert devices_of(ran_a) == f"DEVICES {sorted(ids_a)} [0, 1]"
        assert devices_of(ran_b) == f"DEVICES {sorted(ids_b)} [0]"
        # The pool is full: carol's job waits in the queue, and says so.
        queued = subprocess.Popen(
            [sys.executable, "-m", "isthmus.cli", "run", "--service", service.service,
             "--service-ca", service.ca, "--token-file", service.tokens["carol"],
             "--slices", "1", "--", sys.executable, "-c", JOB],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            assert queued.stderr is not None
            line = queued.stderr.readline()
            assert "position 1 in the queue" in line, line
            assert figures(service)["users_waiting"] == 1
        except BaseException:
            queued.kill()
            raise
    # bob's and alice's leases ended: carol's job starts and finishes.
    stdout, stderr = queued.communicate(timeout=120)
    assert queued.returncode == 0, stderr[-3000:]
    assert f"RESULT {EXPECTED}" in stdout
    wait_until(lambda: figures(service)["capacity_in_use"] == 0, 10, "the leases to end")
    # --log-format json: the fleet's events, one JSON object per line, at the default level.
    events = [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]
    kinds = {e.get("event") for e in events}
    assert {"worker_joined", "group_formed", "lease_granted", "lease_ended"} <= kinds, kinds
    granted = [e for e in events if e.get("event") == "lease_granted"]
    assert {"alice", "bob", "carol"} <= {e["tenant"] for e in granted}
    assert all(e["level"] == "INFO" and "time" in e for e in granted)


def test_a_stranger_is_refused_and_leaves_nothing(service, tmp_path):
    before = service.status()
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-a-tenant\n")
    with pytest.raises(shared.LeaseRefused, match="not known to the service"):
        with shared.lease(service.service, token_file=str(wrong), ca=service.ca):
            pass
    # Without a tunnel at all: the stock client's calls are refused as unauthenticated.
    with pytest.raises(grpc.RpcError) as refused:
        RawSession(service.address, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "shared isthmus service" in refused.value.details()
    after = service.status()
    assert after["sessions_open"] == before["sessions_open"] == 0
    assert after["shared"]["capacity_in_use"] == before["shared"]["capacity_in_use"]
    assert after["shared"]["successful_requests"] == before["shared"]["successful_requests"]
    # Nobody without an admin's tunnel sees sessions or memory figures.
    assert "sessions" not in after and all(w == {} for w in after["workers"].values())


def test_over_quota_and_no_wait_are_refused_in_one_line(service):
    with pytest.raises(shared.LeaseRefused, match="over its quota"):
        with service.lease("bob", slices=2):
            pass
    with service.lease("carol", slices=3):
        with pytest.raises(shared.LeaseRefused, match="no 1 slices are free now"):
            with service.lease("alice", slices=1, wait=0):
                pass
    result = run_isthmus(
        ["run", "--service", service.service, "--service-ca", service.ca, "--token-file",
         service.tokens["bob"], "--slices", "2", "--", "true"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "over its quota" in result.stderr


def test_another_tenants_devices_and_host_buffers_are_not_found(service):
    with service.lease("alice", slices=1) as a, service.lease("bob", slices=1) as b:
        with RawSession(a.target) as sa, RawSession(b.target) as sb:
            init_a = sa.call("init_request").init_response
            init_b = sb.call("init_request").init_response
            ids_a = {d.id for d in init_a.all_devices}
            ids_b = {d.id for d in init_b.all_devices}
            assert ids_a and ids_b and not ids_a & ids_b
            foreign = sorted(ids_b)[0]
            body = sa.msg("GetDefaultLayoutRequest", dims=[4], device_id=foreign)
            body.dtype.kind = body.dtype.KIND_F32
            code, message = status_of(sa.call("get_default_layout_request", body))
            assert code == 5 and "not one of lease" in message  # NOT_FOUND
            # bob's host buffer is not there for alice, even by bob's session id.
            sb.store(7, b"\x01" * 16)
            sa.session_id = init_b.session_id
            with pytest.raises(Exception, match="not open on this server"):
                sa.lookup(7)


def test_a_killed_clients_lease_waits_its_grace_then_frees(service):
    script = (
        "import sys, jax, jax.numpy as jnp\n"
        "from isthmus import shared\n"
        "shared.keep('state', {'w': jnp.arange(8.0) * 3})\n"
        "print('KEPT', flush=True); sys.stdin.readline()\n")
    holder = subprocess.Popen(
        [sys.executable, "-m", "isthmus.cli", "run", "--service", service.service,
         "--service-ca", service.ca, "--token-file", service.tokens["carol"], "--slices", "1",
         "--lease-name", "notebook", "--", sys.executable, "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "KEPT", holder.stderr.read()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the client and its jax die at once
        holder.wait(10)
    # Within the grace period the lease lives on, with its arrays: the same name gets both.
    assert figures(service)["capacity_in_use"] == 1
    with resumed(service, "carol", "notebook") as again:
        took = run_python(
            "import jax, jax.numpy as jnp\n"
            "from isthmus import shared\n"
            "like = {'w': jax.ShapeDtypeStruct((8,), jnp.float32,"
            " sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}\n"
            "print('RESULT', float((shared.take('state', like)['w'] ** 2).sum()))\n",
            again.target)
        assert result_of(took) == float(((np.arange(8.0) * 3) ** 2).sum())
    wait_until(lambda: figures(service)["capacity_in_use"] == 0, 10, "the lease to end")
    # A client that dies and does not come back: its lease ends after the grace period.
    holder = subprocess.Popen(
        [sys.executable, "-m", "isthmus.cli", "run", "--service", service.service,
         "--service-ca", service.ca, "--token-file", service.tokens["carol"], "--slices", "2",
         "--", sys.executable, "-c", "import sys; print('UP', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "UP"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)
    killed = time.monotonic()
    assert figures(service)["capacity_in_use"] == 2
    wait_until(lambda: figures(service)["capacity_in_use"] == 0, GRACE + 10,
               "the grace period to end the lease")
    assert time.monotonic() - killed >= GRACE - 0.5


def test_an_admin_lists_and_revokes_leases(service):
    with service.lease("alice", slices=1) as held:
        listing = run_isthmus(
            ["leases", "--controller", service.service, "--service-ca", service.ca,
             "--token-file", service.tokens["ops"]], timeout=60)
        assert listing.returncode == 0, listing.stderr
        assert f"{held.lease}" in listing.stdout and "alice" in listing.stdout
        refused = run_isthmus(
            ["leases", "--controller", service.service, "--service-ca", service.ca,
             "--token-file", service.tokens["bob"]], timeout=60)
        assert refused.returncode == 1 and "not an admin" in refused.stderr
        revoked = run_isthmus(
            ["leases", "--controller", service.service, "--service-ca", service.ca,
             "--token-file", service.tokens["ops"], "--revoke", held.lease], timeout=60)
        assert revoked.returncode == 0 and f"revoked {held.lease}" in revoked.stdout
        # The revoked lease's tunnel opens no session any more.
        ran = run_python(JOB, held.target, env={**os.environ, "ISTHMUS_CONNECT_TIMEOUT": "3"})
        assert ran.returncode != 0 and "revoked by the service's admin ops" in ran.stderr
    wait_until(lambda: figures(service)["capacity_in_use"] == 0, 10, "the slice to be free")



def test_a_lost_worker_fails_only_its_lease_and_comes_back_to_it(service):
    code = """
import sys
import jax, jax.numpy as jnp
held = jnp.ones(8) * 2
held.block_until_ready()
print("READY", flush=True); sys.stdin.readline()
try:
    float(held.sum())
    print("KEPT")
except Exception as e:
    print("LOST", "DATA_LOSS" in str(e))
fresh = jnp.arange(32.0).reshape(4, 8)  # made again: the old arrays were on the lost host
print("AGAIN", float(jax.jit(lambda a: (a @ a.T).sum() * 0.5)(fresh)))
"""
    with service.lease("alice", slices=1) as a, service.lease("bob", slices=1) as b:
        victim = a.slices[0]

        def kill(_line):
            service.kill_worker(victim)
            service.wait_status(lambda s: str(victim) in s["slices_down"], 20,
                                f"slice {victim} to be down")
            assert result_of(run_python(JOB, b.target)) == EXPECTED  # bob: untouched
            # The restarted worker comes back to alice's lease, which is still hers.
            service.wait_status(lambda s: str(victim) not in s["slices_down"], 90,
                                f"slice {victim} to come back")

        ran = run_python_with_pause(code, a.target, kill)
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert "LOST True" in ran.stdout and f"AGAIN {EXPECTED}" in ran.stdout, ran.stdout
        assert figures(service)["capacity_in_use"] == 2


def test_a_client_that_names_a_lease_the_service_does_not_know_hears_it_is_gone(service):
    """What every client hears after the service restarted: its lease is gone, said once."""
    token = shared.read_token_file(service.tokens["alice"])
    forwarder = shared.Forwarder(service.service, token, service.ca)
    try:
        client = shared.LeaseClient(forwarder, lambda line: None)
        call = client._lease(json.dumps({"resume": "L999"}).encode())
        with pytest.raises(grpc.RpcError) as gone:
            next(iter(call))
        assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "lease L999 is not live on this service" in gone.value.details()
        assert "restarted" in gone.value.details()
        client.release()
    finally:
        forwarder.close()


def test_connect_in_python_through_the_unix_socket_with_pathwaysutils(service):
    """isthmus.shared.connect as a notebook uses it, here over the service's Unix socket
    (no TLS: client and service share the machine); pathwaysutils.initialize() is called."""
    pytest.importorskip("pathwaysutils")
    code = f"""
import isthmus.shared, numpy as np
with isthmus.shared.connect({service.unix!r}, slices=2, token_file={service.tokens['carol']!r}
                            ) as grant:
    import jax, jax.numpy as jnp, pathwaysutils
    assert pathwaysutils.is_pathways_backend_used()
    print("SLICES", sorted({{d.slice_index for d in jax.devices()}}), len(grant.slices))
    print("RESULT", float(jax.jit(lambda a: (a @ a.T).sum() * 0.5)(
        jnp.arange(32.0).reshape(4, 8))))
"""
    ran = run_python(code, None)
    assert "SLICES [0, 1] 2" in ran.stdout, ran.stderr[-3000:]
    assert result_of(ran) == EXPECTED
    wait_until(lambda: figures(service)["capacity_in_use"] == 0, 10, "the lease to end")


def test_the_stock_clients_own_proxy_route_when_the_operator_allows_it(service):
    """With --allow-plain-connect, the stock client alone reaches its tenant's lease through
    grpc_proxy=http://TENANT:TOKEN@service (credentials in clear: opt-in only)."""
    token = shared.read_token_file(service.tokens["alice"])
    with service.lease("alice", slices=1) as held:
        env = {**os.environ, "grpc_proxy": f"http://alice:{token}@{service.service}",
               "no_grpc_proxy": "", "no_proxy": ""}
        ran = run_python(JOB, service.address, env=env)
        assert result_of(ran) == EXPECTED
        assert devices_of(ran) == f"DEVICES {[2 * held.slices[0], 2 * held.slices[0] + 1]} [0]"


# A command as a user's shell starts it, with SIGINT's default action, whatever this process
# inherited: a suite started as a background job (`scripts/test &`, nohup) has SIGINT ignored,
# and an ignored signal stays ignored across exec (right for `isthmus run`, wrong for a test
# that interrupts one). A wrapper, not preexec_fn: this process has threads.
WITH_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
               "signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


def test_ctrl_c_while_queued_leaves_the_queue(service):
    with service.lease("carol", slices=3):
        waiting = subprocess.Popen(
            [*WITH_SIGINT, "-m", "isthmus.cli", "run", "--service", service.service,
             "--service-ca", service.ca, "--token-file", service.tokens["alice"],
             "--slices", "1", "--", "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            assert waiting.stderr is not None
            assert "position 1 in the queue" in waiting.stderr.readline()
            waiting.send_signal(signal.SIGINT)
            assert waiting.wait(20) == 130
            assert "left the queue" in waiting.stderr.read()
        finally:
            if waiting.poll() is None:
                waiting.kill()
        wait_until(lambda: figures(service)["users_waiting"] == 0, 10, "the queue to empty")
        assert figures(service)["capacity_in_use"] == 3


ELASTIC_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                              "elastic_train.py")


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]
    return [json.loads(line) for line in lines if line]


@pytest.mark.slow
def test_a_higher_priority_reclaims_a_slice_of_an_elastic_job(service, tmp_path):
    """carol trains elastically on 2 slices, alice holds the third; bob (priority 5) asks
    for one: carol's second slice is reclaimed (DATA_LOSS there), her training goes on on
    one slice, and when bob is done the slice comes back and training scales up again."""
    pytest.importorskip("optax")
    log = tmp_path / "train.jsonl"
    out = open(tmp_path / "train.out", "w")
    with service.lease("alice", slices=1):
        trainer = subprocess.Popen(
            [sys.executable, "-m", "isthmus.cli", "run", "--service", service.service,
             "--service-ca", service.ca, "--token-file", service.tokens["carol"],
             "--slices", "2", "--elastic", "--", sys.executable, ELASTIC_SCRIPT,
             "--steps", "80", "--snapshot-every", "5", "--poll-interval", "0.5",
             "--step-delay", "0.05", "--print-every", "10", "--log-json", str(log)],
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            def steps():
                return [r for r in _records(log) if r["kind"] == "step"]
            wait_until(lambda: len(steps()) >= 10 or trainer.poll() is not None, 120,
                       "10 steps on 2 slices")
            assert trainer.poll() is None, (tmp_path / "train.out").read_text()[-4000:]
            with service.lease("bob", slices=1) as b:
                ran = run_python(JOB, b.target)
                assert result_of(ran) == EXPECTED
                on_one = len(steps())
                wait_until(lambda: any(s["slices"] == [0] for s in steps()) or
                           trainer.poll() is not None, 60, "steps on the remaining slice")
            trainer.wait(180)
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
            out.close()
    output = (tmp_path / "train.out").read_text()
    assert trainer.returncode == 0, output[-4000:]
    records = _records(log)
    attempts = [r for r in records if r["kind"] == "attempt"]
    assert [a["slices"] for a in attempts] == [[0, 1], [0], [0, 1]], attempts
    assert [a["end"] for a in attempts] == ["error", "scale_up", "done"], attempts
    assert "DATA_LOSS" in attempts[0]["error"] and "reclaimed" in attempts[0]["error"]
    done = [r for r in records if r["kind"] == "step"]
    assert {s["step"] for s in done} == set(range(1, 81)) and on_one >= 10
    assert all(math.isfinite(s["loss"]) for s in done)
