"""A shared service's leases as a second client of the same tenant would try them: naming a
lease its first client still holds (by id), and names too long to keep and show (a lease's,
a program's); and `isthmus up` given a FIFO or a non-UTF-8 file for its tenants or tokens.

A 1-slice CPU fleet of its own; the test process holds leases itself (`isthmus.shared.lease`)
and runs the stock jax client in subprocesses through the lease's tunnel; results are
compared with numpy.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import grpc
import pytest

from isthmus import shared
from isthmus.testing import run_isthmus, run_python, wait_until
from tests.integration.shared_service import EXPECTED, JOB, SharedService, result_of

pytestmark = pytest.mark.one_environment  # the server's own code: one environment runs it


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with SharedService(tmp_path_factory.mktemp("tenants"), (1, 1, 2),
                       {"alice": {"max_slices": 1}, "bob": {"max_slices": 1}},
                       {"grace_seconds": 30}, args=["--log-level", "INFO"]) as server:
        yield server


class Client:
    """A second client of a tenant, speaking the lease protocol itself (as any program with
    the tenant's token can): `ask` sends one request and returns its first update."""

    def __init__(self, service, who):
        token = shared.read_token_file(service.tokens[who])
        self.forwarder = shared.Forwarder(service.service, token, service.ca)
        self.lines = []
        self.client = shared.LeaseClient(self.forwarder, self.lines.append)

    def ask(self, request):
        call = self.client._lease(json.dumps(request).encode(), timeout=30)
        try:
            return json.loads(next(iter(call)))
        finally:
            call.cancel()

    def close(self):
        self.client.release()
        self.forwarder.close()


def in_use(service):
    return service.status()["shared"]["capacity_in_use"]


def refused(service):
    return service.status()["shared"]["refused_requests"]


def test_a_held_lease_is_not_resumed_by_id_by_another_client(service):
    """alice's job holds lease L; a second client of alice that names L by id is refused as
    one naming it by name is, and the job goes on alone. Once the job's stream is gone, its
    own client comes back to L by id (it retries while the service still counts it)."""
    with service.lease("alice", slices=1, name="job") as held:
        second = Client(service, "alice")
        try:
            with pytest.raises(grpc.RpcError) as refused:
                second.ask({"resume": held.lease})
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details() == (
                f"lease 'job' ({held.lease}) is in use by another client of tenant alice; "
                "end that client or ask for a lease of its own.")
            with pytest.raises(grpc.RpcError) as by_name:  # the by-name path, as before
                second.ask({"slices": 1, "name": "job"})
            assert by_name.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "in use by another client of tenant alice" in by_name.value.details()
            # bob does not reach alice's lease at all.
            other = Client(service, "bob")
            try:
                with pytest.raises(grpc.RpcError) as foreign:
                    other.ask({"resume": held.lease})
                assert foreign.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"lease {held.lease} is not live for tenant bob" in (
                    foreign.value.details())
            finally:
                other.close()
            # The first client's job is untouched.
            assert result_of(run_python(JOB, held.target)) == EXPECTED
            assert in_use(service) == 1
        finally:
            second.close()


def test_a_client_whose_stream_broke_comes_back_once_the_service_saw_it_go(service):
    """The service may still count a broken stream for a moment: the client's own resume by
    id retries through that refusal, and gets its lease back when the stream is gone."""
    first = Client(service, "alice")
    again = Client(service, "alice")
    try:
        grant = first.client.acquire(1, name="notebook")
        again.client.grant = grant
        refusals = refused(service)
        back = []
        resumer = threading.Thread(target=lambda: back.append(again.client._resume("test")),
                                   daemon=True)
        resumer.start()
        wait_until(lambda: refused(service) >= refusals + 2, 20,
                   "the service to refuse the resume while the first stream holds the lease")
        assert not back and again.client.end_reason is None  # it keeps trying
        first.client.call.cancel()  # the first client's stream breaks
        resumer.join(30)
        assert back and back[0] is not None, again.lines
        assert again.lines[-1] == f"isthmus: back on lease {grant.lease}"
        assert again.client.end_reason is None
        assert in_use(service) == 1
        path = again.forwarder.listen(f"lease/{grant.lease}", "jax")
        assert result_of(run_python(JOB, f"grpc://unix:{path}")) == EXPECTED
    finally:
        again.close()
        first.close()
    wait_until(lambda: in_use(service) == 0, 10, "the lease to end")


@pytest.mark.parametrize("name", ["x" * 65, "my notebook", "n" * (8 << 20)])
def test_a_lease_name_past_the_bound_is_refused(service, name):
    """The service refuses a name it would keep and show (every page poll, `isthmus leases`)
    past 64 characters of a safe set, naming the bound; nothing is queued or granted."""
    client = Client(service, "alice")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.ask({"slices": 1, "name": name})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(
            "a lease name is at most 64 letters, digits, '_', '.' and '-', not ")
        assert len(refused.value.details()) < 200
        figures = service.status()["shared"]
        assert (figures["capacity_in_use"], figures["users_waiting"]) == (0, 0)
    finally:
        client.close()


def test_isthmus_run_refuses_a_long_lease_name_at_once(service):
    """`isthmus run --service --lease-name` refuses before it asks: one line, exit 2."""
    before = service.status()["shared"]
    ran = run_isthmus(
        ["run", "--service", service.service, "--service-ca", service.ca, "--token-file",
         service.tokens["alice"], "--lease-name", "y" * 100, "--", sys.executable, "-c",
         "print('RAN')"], timeout=120)
    assert ran.returncode == 2 and "RAN" not in ran.stdout
    assert ran.stderr.strip().splitlines() == [
        "isthmus run: a lease name is at most 64 letters, digits, '_', '.' and '-', not "
        "'yyyyyyyyyyyyyyyyyyyyyyyy... (100 characters)'; pick such a name."], ran.stderr
    after = service.status()["shared"]
    assert [after[k] - before[k] for k in ("refused_requests", "successful_requests")] == [0, 0]


LONG_NAME = """
import jax, jax.numpy as jnp
def f(a):
    return (a @ a.T).sum() * 0.5
f.__name__ = f.__qualname__ = "model_" + "v" * 20000
print("RESULT", float(jax.jit(f)(jnp.arange(32.0).reshape(4, 8))))
"""


def test_a_programs_name_is_shown_bounded(service):
    """A program's name is its client's (the jitted function's): logs and the live page's
    events show at most 128 characters of it, and the program runs as it is."""
    with service.lease("alice", slices=1) as held:
        assert result_of(run_python(LONG_NAME, held.target)) == EXPECTED
    log = service.log()
    name = "jit_model_" + "v" * 20000
    assert f"compiled {name[:128]}... (20010 characters) for devices" in log, log[-3000:]
    assert "v" * 129 not in log



@pytest.mark.parametrize("mistake", ["fifo token", "fifo tenants", "latin-1"])
def test_isthmus_up_refuses_a_fifo_or_a_non_utf8_file_in_one_line(tmp_path, mistake):
    """`isthmus up --tenants` with a FIFO where a token file or the tenants file should be
    (reading one would wait for a writer forever) or a file that is not UTF-8: one line
    naming the file, exit 2, at start."""
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text('[tenants.alice]\ntoken_file = "alice.token"\nmax_slices = 1\n')
    if mistake == "fifo token":
        os.mkfifo(tmp_path / "alice.token")
        expected = f"the token file {tmp_path}/alice.token is a FIFO"
    elif mistake == "fifo tenants":
        tenants_file = tmp_path / "fifo.toml"
        os.mkfifo(tenants_file)
        expected = f"the tenants file {tenants_file} is a FIFO"
    else:
        tenants_file.write_bytes("# Zoë's team\n".encode("latin-1"))
        expected = f"the tenants file {tenants_file} is not UTF-8 text (byte 4)"
    ran = run_isthmus(["up", "--tenants", str(tenants_file), "--slices", "1"], timeout=60)
    assert ran.returncode == 2, ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert ran.stderr.startswith(f"isthmus: {expected}"), ran.stderr
