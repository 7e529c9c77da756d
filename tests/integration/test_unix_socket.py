"""Issue 48: the client port on a Unix socket, for machines where no TCP socket may be opened
(a TPU sandbox). `isthmus run` hands its command a private socket by default; `isthmus up
--unix-socket PATH` serves one (mode 0600), with no TCP port; the stock client and `isthmus
status` reach it as grpc://unix:PATH. A fleet served so runs its control streams, peer data
and group formation over Unix sockets beside it, with no gloo in a one-host group. Results
equal numpy's, and neither the server nor its workers hold a TCP or UDP socket."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from isthmus.serve import READY_PREFIX, child_environment
from isthmus.testing import run_isthmus

# The inodes of this process's (or another's) sockets that are TCP or UDP, IPv4 or 6.
INET_SOCKETS = '''
import os
def inet_sockets(pid):
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    inet = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                inet.update(line.split()[9] for line in list(f)[1:])
        except OSError:
            pass
    return sorted(mine & inet)
'''

CLIENT = INET_SOCKETS + '''
import sys
import jax, jax.numpy as jnp, numpy as np
server = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
x = np.arange(32, dtype=np.float32).reshape(8, 4)
out = np.asarray(jax.jit(lambda v: jnp.tanh(v) @ v.T + 1)(x))
np.testing.assert_allclose(out, np.tanh(x) @ x.T + 1, rtol=1e-6)
assert os.environ["JAX_BACKEND_TARGET"].startswith("grpc://unix:"), os.environ
print("inet sockets of the server:", inet_sockets(server))
assert not inet_sockets(server)
print("OK", len(jax.devices()))
'''


def test_isthmus_run_hands_its_command_a_private_unix_socket(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    result = subprocess.run(
        [sys.executable, "-m", "isthmus.cli", "run", "--devices", "2", "--",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "OK 2", result.stdout


@pytest.mark.parametrize("shape", [["--devices", "2"], [
    "--slices", "1", "--hosts-per-slice", "1", "--devices-per-host", "2"]],
    ids=["embedded", "one-host-fleet"])
def test_isthmus_up_serves_a_unix_socket_and_no_tcp_port(tmp_path, shape):
    path = str(tmp_path / "isthmus.sock")
    server = subprocess.Popen(
        [sys.executable, "-m", "isthmus.cli", "up", *shape, "--unix-socket", path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith(READY_PREFIX), line + server.stderr.read()[-3000:]
        address = line.strip().removeprefix(READY_PREFIX)
        assert address == f"grpc://unix:{path}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # this user's clients only
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        result = subprocess.run([sys.executable, str(script), str(server.pid)],
                                env=child_environment(address, dict(os.environ)),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr[-4000:]
        assert result.stdout.strip().splitlines()[-1] == "OK 2"
        status = run_isthmus(["status", "--controller", f"unix:{path}", "--json"], timeout=60)
        assert status.returncode == 0, status.stderr
        assert '"devices"' in status.stdout
        workers = [w["pid"] for w in json.loads(status.stdout)["fleet"].values()]
        assert len(workers) == (1 if "--slices" in shape else 0)
        namespace: dict = {}
        exec(INET_SOCKETS, namespace)
        for pid in workers:  # control stream, peer data, group formation: all Unix
            assert not namespace["inet_sockets"](pid), f"worker {pid} holds TCP or UDP"
    finally:
        server.terminate()
        server.wait(30)
    assert server.returncode == 0


def test_a_local_server_where_tcp_is_refused_serves_a_private_socket(monkeypatch):
    """`LocalServer` (tests, benches) on a machine that refuses TCP: its client port is a Unix
    socket in a private folder, which its stop removes."""
    import isthmus.testing
    from tests.integration.harness import run_snippet

    monkeypatch.setattr(isthmus.testing, "tcp_available", lambda: False)
    server = isthmus.testing.LocalServer(devices=1)
    with server:
        assert server.address.startswith("grpc://unix:"), server.address
        folder = os.path.dirname(server.address[len("grpc://unix:"):])
        out = run_snippet("import jax.numpy as jnp\nemit('x', jnp.arange(4) * 2)",
                          server.address)
        assert out["x"].tolist() == [0, 2, 4, 6]
    assert not os.path.exists(folder)
