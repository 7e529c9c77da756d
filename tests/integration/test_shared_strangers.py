"""Strangers get nothing and cost little (issue 38, items 5 to 9), tried as an attacker would.

One shared service on a 2-slice CPU fleet with small limits. Strangers come from other
loopback addresses (127.0.0.2 and up: another host, as the service tells peers apart by
source address) and speak raw HTTP/2 or plain HTTP; tenants hold leases and run the stock
jax client through them. Every wait is bounded; results are compared with numpy.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import urllib.request

import hpack
import numpy as np
import pytest

from isthmus.serve import METRICS_PREFIX
from isthmus.testing import run_isthmus, run_python, wait_until
from tests.integration.shared_service import SharedService

pytestmark = pytest.mark.one_environment  # the server's own code: one environment runs it

AUTH_SECONDS = 2.0
PEER_CONNECTIONS = 3
PEER_REQUESTS = 5
UPLOAD_CAP = 4 << 20  # alice's max_upload_bytes
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS = 0x0, 0x1, 0x4
END_STREAM, END_HEADERS = 0x1, 0x4
OK, RESOURCE_EXHAUSTED, UNAUTHENTICATED = 0, 8, 16
STATUS = "/isthmus.Admin/Status"
TENANTS = {"alice": {"max_slices": 1, "max_upload_bytes": UPLOAD_CAP},
           "bob": {"max_slices": 1}, "ops": {"max_slices": 0}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with SharedService(tmp_path_factory.mktemp("strangers"), (2, 1, 1), TENANTS,
                       {"admins": ["ops"]}, args=[
            "--log-level", "INFO", "--auth-timeout", str(AUTH_SECONDS),
            "--peer-connections", str(PEER_CONNECTIONS), "--peer-requests", str(PEER_REQUESTS),
            "--metrics-port", "0"]) as server:
        server.metrics = wait_until(lambda: _metrics_url(server), 30, "the metrics URL")
        yield server
        assert server.alive(), server.log()


def _metrics_url(server):
    for line in server.log().splitlines():
        if METRICS_PREFIX in line:
            return line.split(METRICS_PREFIX, 1)[1].split("/metrics", 1)[0]
    return None


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


class Stranger:
    """A raw HTTP/2 connection from `source` (another address of this machine's loopback:
    to the service, another host)."""

    def __init__(self, service, source: str, preface: bool = True) -> None:
        host, port = service.service.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10,
                                             source_address=(source, 0))
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.buffer = b""
        self.statuses: dict[int, tuple[int, str]] = {}
        self.settings = False  # the server's SETTINGS came: it serves this connection
        self.closed = False
        if preface:
            self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def call(self, stream: int, path: str = STATUS) -> None:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"),
                                     (":path", path), (":authority", "x"),
                                     ("content-type", "application/grpc"), ("te", "trailers")])
        try:
            self.sock.sendall(frame(HEADERS, END_HEADERS, stream, block)
                              + frame(DATA, END_STREAM, stream, b"\0\0\0\0\0"))
        except OSError:
            self.closed = True

    def read(self, until, timeout: float) -> Stranger:
        """Reads the server's frames until `until(self)`, the connection's end, or
        `timeout` s (then AssertionError)."""
        deadline = time.monotonic() + timeout
        while not until(self) and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"nothing within {timeout} s: statuses {self.statuses}, "
                                     f"settings {self.settings}")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
            self.buffer += chunk
            while len(self.buffer) >= 9:
                length = int.from_bytes(self.buffer[:3], "big")
                if len(self.buffer) < 9 + length:
                    break
                kind, stream = self.buffer[3], int.from_bytes(self.buffer[5:9], "big")
                payload, self.buffer = self.buffer[9:9 + length], self.buffer[9 + length:]
                if kind == SETTINGS:
                    self.settings = True
                elif kind == HEADERS:
                    fields = dict(self.decoder.decode(payload))
                    if "grpc-status" in fields:
                        self.statuses[stream] = (int(fields["grpc-status"]),
                                                 fields.get("grpc-message", ""))
        return self

    def close(self) -> None:
        self.sock.close()


# ---- item 5: idle connections, and connections per peer -------------------------------------


def test_idle_connections_are_closed_after_the_auth_timeout(service):
    """Connections that send only the HTTP/2 preface (or nothing, or half a CONNECT) are
    closed once the auth timeout has passed, from another host and from this machine; the
    fleet's own workers (their pulses on the same port) stay."""
    idle = [Stranger(service, "127.0.0.2"), Stranger(service, "127.0.0.1"),
            Stranger(service, "127.0.0.1", preface=False)]
    half = Stranger(service, "127.0.0.1", preface=False)
    half.sock.sendall(b"CONNECT control HTTP/1.1\r\n")
    opened = time.monotonic()
    for stranger in [*idle, half]:
        stranger.read(lambda s: False, timeout=AUTH_SECONDS + 10)  # returns once closed
        assert stranger.closed
        stranger.close()
    assert time.monotonic() - opened >= AUTH_SECONDS * 0.9
    time.sleep(AUTH_SECONDS)  # the workers' pulse connections have outlived the timeout
    assert service.status()["slices_down"] == {}
    with service.lease("bob", slices=1) as grant:
        ran = run_python("import jax, jax.numpy as jnp\n"
                         "print('RESULT', float(jnp.arange(10.0).sum()))", grant.target)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"RESULT {float(np.arange(10.0).sum())}" in ran.stdout


def test_a_peer_over_its_connection_cap_is_refused(service):
    """A host holds at most --peer-connections connections without credentials: the next
    is closed at once, unserved; another host is served meanwhile."""
    held = [Stranger(service, "127.0.0.3").read(lambda s: s.settings, timeout=10)
            for _ in range(PEER_CONNECTIONS)]
    try:
        assert all(s.settings and not s.closed for s in held)
        over = Stranger(service, "127.0.0.3").read(lambda s: s.settings, timeout=10)
        assert over.closed and not over.settings
        over.close()
        other = Stranger(service, "127.0.0.4").read(lambda s: s.settings, timeout=10)
        assert other.settings and not other.closed
        other.close()
    finally:
        for stranger in held:
            stranger.close()


def test_a_peer_over_its_request_rate_is_refused(service):
    """Calls without credentials from one host beyond --peer-requests a second are refused
    with RESOURCE_EXHAUSTED naming the setting, and the connection is closed."""
    stranger = Stranger(service, "127.0.0.5")
    for stream in range(1, 4 * PEER_REQUESTS * 2, 2):
        stranger.call(stream)
    stranger.read(lambda s: any(code == RESOURCE_EXHAUSTED for code, _ in s.statuses.values()),
                  timeout=10)
    stranger.read(lambda s: False, timeout=10)  # then it is closed
    stranger.close()
    refused = [m for code, m in stranger.statuses.values() if code == RESOURCE_EXHAUSTED]
    assert refused and "--peer-requests" in refused[0], stranger.statuses
    answered = [code for code, _ in stranger.statuses.values() if code != RESOURCE_EXHAUSTED]
    assert len(answered) <= PEER_REQUESTS and stranger.closed, stranger.statuses


# ---- item 8: what a stranger's Status says --------------------------------------------------


def test_a_stranger_status_says_only_that_a_credential_is_needed(service):
    """From another host, Admin/Status is UNAUTHENTICATED with the way to ask: no platform,
    jax version, devices, hosts or pids. The operator's `isthmus status` works on the
    service's machine, and anywhere with a tenant's token (an admin's sees sessions)."""
    stranger = Stranger(service, "127.0.0.6")
    stranger.call(1)
    code, message = stranger.read(lambda s: 1 in s.statuses, timeout=10).statuses[1]
    stranger.close()
    assert code == UNAUTHENTICATED, message
    assert "--token-file" in message
    local = service.status()  # the service's own machine
    pids = [str(entry["pid"]) for entry in local["fleet"].values()]
    import jax

    for secret in ["cpu", jax.__version__, *pids, "devices", "host"]:
        assert secret not in message, secret

    def status(*extra):
        return run_isthmus(["status", "--controller", service.service, "--json", *extra],
                           timeout=60)

    here = status()
    assert here.returncode == 0, here.stderr
    assert json.loads(here.stdout)["platform"]["name"] == "cpu"
    as_admin = status("--token-file", service.tokens["ops"], "--service-ca", service.ca)
    assert as_admin.returncode == 0, as_admin.stderr
    assert "sessions" in json.loads(as_admin.stdout)
    as_tenant = status("--token-file", service.tokens["bob"], "--service-ca", service.ca)
    assert as_tenant.returncode == 0, as_tenant.stderr
    assert "redacted" in json.loads(as_tenant.stdout)


# ---- item 9: the live view's data -----------------------------------------------------------


def test_api_state_shows_tenants_only_with_an_admin_token(service):
    """/api/state names tenants, leases and programs only to a request with an admin's
    token; without one (or with a tenant's), the fleet's health only."""
    program = """
import jax, jax.numpy as jnp
def alice_secret_model_v7(x):
    return x * 2.0 + 1.0
print("RESULT", float(jax.jit(alice_secret_model_v7)(jnp.arange(8.0)).sum()))
"""
    with service.lease("alice", slices=1, name="alice-secret-lease") as grant:
        ran = run_python(program, grant.target)
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert f"RESULT {float((np.arange(8.0) * 2.0 + 1.0).sum())}" in ran.stdout

        def get(token=None):
            request = urllib.request.Request(service.metrics + "/api/state", headers={
                "Authorization": f"Bearer {token}"} if token else {})
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.read().decode()

        def admin_sees_all():
            body = get(service.secrets["ops"])
            return body if "alice_secret_model_v7" in body else None

        as_admin = wait_until(admin_sees_all, 20, "the admin's view to show the program")
        assert "alice-secret-lease" in as_admin and '"alice"' in as_admin
        for body in (get(), get(service.secrets["alice"]), get("not-a-token")):
            for secret in ("alice", "secret", "jit_"):
                assert secret not in body, (secret, body[:2000])
            state = json.loads(body)
            assert [s["up"] for s in state["slices"]] == [True, True]  # the fleet's health
            assert state["shared"]["leases"] == [] and "redacted" in state


# ---- item 7: a tenant's uploads -------------------------------------------------------------


def test_a_tenant_over_its_upload_cap_is_refused_and_keeps_its_arrays(service):
    """An upload beyond the tenant's max_upload_bytes fails the array it was for with
    RESOURCE_EXHAUSTED naming the setting; the tenant's other arrays stay valid, and later
    uploads under the cap work."""
    program = f"""
import jax, jax.numpy as jnp, numpy as np
small = jax.device_put(np.arange(1000.0, dtype=np.float32))
try:
    big = jax.device_put(np.ones({UPLOAD_CAP // 4 + 1024}, np.float32))
    print("BIG", float(np.asarray(big).sum()))
except Exception as e:
    print("REFUSED", " ".join(str(e).split()))
print("SMALL", float(np.asarray(small).sum()), float((small * 2).sum()))
again = jax.device_put(np.full(1000, 3.0, np.float32))
print("AGAIN", float(np.asarray(again + small).sum()))
"""
    with service.lease("alice", slices=1) as grant:
        ran = run_python(program, grant.target)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in ran.stdout.splitlines()
             if " " in line}
    assert "REFUSED" in lines, ran.stdout
    assert "RESOURCE_EXHAUSTED" in lines["REFUSED"] and "max_upload_bytes" in lines["REFUSED"]
    small = np.arange(1000.0, dtype=np.float32)
    assert lines["SMALL"] == f"{float(small.sum())} {float((small * 2).sum())}"
    assert lines["AGAIN"] == f"{float((small + 3.0).sum())}"

