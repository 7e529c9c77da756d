"""A fleet with a token (`--token-file`, $ISTHMUS_FLEET_TOKEN): its launched workers join and
move data between each other; a worker without the token, or with another, is refused with
one line on each side and gets nothing."""

import os
import subprocess

import pytest

from isthmus.testing import LocalServer, run_isthmus, run_python

CLIENT = """
import jax, numpy as np
a, b = jax.devices()[:2]
x = jax.device_put(np.arange(6.0).reshape(2, 3), a)
y = jax.device_put(x, b)  # worker to worker: a peer pull, with the fleet's MAC
np.testing.assert_array_equal(np.asarray(y), np.arange(6.0).reshape(2, 3))
print("moved", y.devices())
"""


def _worker(address: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run_isthmus(["worker", "--controller", address.removeprefix("grpc://"), "--devices",
                        "1", *args], env=env, timeout=60)


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_a_fleet_with_a_token_refuses_workers_without_it(tmp_path):
    token = tmp_path / "token"
    token.write_text("a secret of this fleet\n")
    base = {k: v for k, v in os.environ.items() if k != "ISTHMUS_FLEET_TOKEN"}
    with LocalServer(devices=None, fleet=(2, 1, 1), args=["--token-file", str(token)],
                     env=base) as server:
        result = run_python(CLIENT, server.address)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "moved" in result.stdout

        stranger = _worker(server.address, base)
        assert stranger.returncode == 2, stranger.stderr[-2000:]
        assert "refused this worker" in stranger.stderr
        assert "does not know this worker's fleet token" in stranger.stderr
        other = _worker(server.address, {**base, "ISTHMUS_FLEET_TOKEN": "another secret"})
        assert other.returncode == 2 and "refused this worker" in other.stderr
        # Logged once for its host, however often strangers knock from there.
        assert server.log().count("refused a worker stream") == 1, server.log()[-3000:]
        assert len(server.status()["fleet"]) == 2  # nobody else joined
        assert server.alive()


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_a_token_file_that_cannot_be_read_is_one_line(tmp_path):
    missing = tmp_path / "nope"
    for command in (["up", "--slices", "1"], ["worker", "--controller", "127.0.0.1:1"]):
        result = run_isthmus([*command, "--token-file", str(missing)], timeout=60)
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr.strip().splitlines() == [
            f"isthmus: --token-file {missing}: No such file or directory"], result.stderr

