"""Mutual TLS in the fleet (`--tls-cert/--tls-key/--tls-ca`): a TLS fleet computes and
moves data between workers (peer pulls over TLS) with results equal to numpy; a worker with
another CA's certificate, or without TLS, is refused with one line on each side and exit
code 2; incomplete or mismatched options are one line and exit code 2."""

import shutil
import subprocess
import sys

import pytest

from isthmus.ports import free_port
from isthmus.testing import LocalServer, run_isthmus, run_python, wait_until

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_fleet_ca(directory):
    """A CA and two member certificates with the fleet's name, as docs/design.md says."""
    directory.mkdir()

    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=isthmus test CA")
    (directory / "ext.cnf").write_text("subjectAltName=DNS:isthmus-fleet\n")
    for name in ("controller", "worker"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf")
    return directory


def options(ca, name):
    return ["--tls-cert", str(ca / f"{name}.pem"), "--tls-key", str(ca / f"{name}.key"),
            "--tls-ca", str(ca / "ca.pem")]


CLIENT = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
mesh = Mesh(np.array(devices), ("x",))
x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("x")))
np.testing.assert_allclose(float(jax.jit(lambda v: (v * v).sum())(x)), (np.arange(8.0) ** 2).sum())
y = jax.device_put(np.arange(6.0), devices[0])
moved = jax.device_put(y, devices[-1])  # another worker: a peer pull
np.testing.assert_array_equal(np.asarray(moved), np.arange(6.0))
print("OK", len(devices))
"""


def test_a_tls_fleet_computes_and_moves_data(tmp_path):
    ca = make_fleet_ca(tmp_path / "ca")
    with LocalServer(devices=None, fleet=(1, 2, 1), args=options(ca, "controller")) as server:
        result = run_python(CLIENT, server.address, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert "OK 2" in result.stdout


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_strangers_are_refused(tmp_path):
    ours, theirs = make_fleet_ca(tmp_path / "ours"), make_fleet_ca(tmp_path / "theirs")
    # A --no-launch controller prints its ready line only once its fleet is complete, so it
    # is started by hand here rather than through LocalServer.
    port = free_port()
    controller = subprocess.Popen(
        [sys.executable, "-m", "isthmus.cli", "up", "--no-launch", "--port", str(port),
         "--slices", "1", "--hosts-per-slice", "1", "--devices-per-host", "1",
         *options(ours, "controller")], stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_port(port, 120)
        results = {}
        for label, extra in (("other CA", options(theirs, "worker")), ("no TLS", [])):
            results[label] = run_isthmus(
                ["worker", "--controller", f"127.0.0.1:{port}", "--devices", "1",
                 "--connect-timeout", "120", *extra], timeout=120)
    finally:
        controller.terminate()
        _, controller_log = controller.communicate(timeout=60)
    for label, result in results.items():
        assert result.returncode == 2, (label, result.stderr)
        lines = [line for line in result.stderr.splitlines() if "refused this worker" in line]
        assert len(lines) == 1, (label, result.stderr)
    assert "CERTIFICATE_VERIFY_FAILED" in results["other CA"].stderr
    assert "requires TLS" in results["no TLS"].stderr
    refusals = [line for line in controller_log.splitlines() if "TLS handshake failed" in line]
    assert len(refusals) == 2, controller_log


@pytest.mark.one_environment  # the server's own code: one environment runs it
@pytest.mark.parametrize("which", ["partial", "mismatched"])
def test_bad_tls_options_are_refused(tmp_path, which):
    ca = make_fleet_ca(tmp_path / "ca")
    if which == "partial":
        extra, message = options(ca, "controller")[:4], "needs all three"
    else:
        extra = ["--tls-cert", str(ca / "controller.pem"), "--tls-key",
                 str(ca / "worker.key"), "--tls-ca", str(ca / "ca.pem")]
        message = "do not load together"
    result = run_isthmus(["up", "--port", "0", "--slices", "1", *extra], timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr



def _wait_for_port(port, timeout):
    import socket

    def listening():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_until(listening, timeout, f"the controller to listen on {port}", interval=0.2)
