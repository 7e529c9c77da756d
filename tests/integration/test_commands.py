"""The commands and entry points a user starts with: isthmus up/run/status, connect(),
pathwaysutils."""

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from isthmus.ports import free_port
from isthmus.testing import LocalServer, run_isthmus
from tests.integration.harness import compare, run_snippet


def _isthmus(*args, **kwargs):
    return run_isthmus(args, **kwargs)


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_up_prints_ready_line_and_stops_cleanly_on_sigterm_and_sigint():
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = LocalServer(devices=2)
        address = server.start()
        assert address.startswith("grpc://127.0.0.1:")
        server.process.send_signal(sig)
        assert server.process.wait(20) == 0
        log = server.log()
        assert "Traceback" not in log, log


def test_run_needs_no_code_change_and_returns_the_exit_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import jax, sys\n"
        "import jax.numpy as jnp\n"
        "print('platform', jax.devices()[0].client.platform_version, jax.device_count())\n"
        "print('value', float(jax.jit(lambda x: (x * x).sum())(jnp.arange(4.0))))\n"
        "sys.exit(3)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    result = _isthmus("run", "--devices", "3", "--", sys.executable, str(script), env=env,
                      timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "platform isthmus 3" in result.stdout
    assert "value 14.0" in result.stdout
    missing = _isthmus("run", "--", "/no/such/program", env=env, timeout=60)
    assert missing.returncode == 127 and "cannot start" in missing.stderr


def test_status_command(server):
    result = _isthmus("status", "--controller", server.address, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "slice 0:" in result.stdout
    if server.kind == "fleet":
        assert "slice 1:" in result.stdout and "devices 6..7" in result.stdout
        # Every local worker (a worker still applying commands adds ", backlog N" after it).
        assert result.stdout.count(", shared memory") == 4
    else:
        assert "devices 0..7" in result.stdout
    bad = _isthmus("status", "--controller", "127.0.0.1:1", "--timeout", "2", timeout=60)
    assert bad.returncode == 1 and "cannot reach" in bad.stderr
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "UNAVAILABLE" in lines[0], bad.stderr  # one line, no dump


def test_connect_in_the_script(server):
    out = run_snippet(f"""
        import os
        for k in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET",
                  "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"):
            os.environ.pop(k, None)
        import isthmus
        isthmus.connect("{server.address}")
        import jax
        emit("version", jax.devices()[0].client.platform_version)
        emit("y", jax.jit(lambda a: a + 1)(np.arange(3)))
        try:
            isthmus.connect("{server.address}")
            emit("second", "no error")
        except RuntimeError as e:
            emit("second", str(e))
    """, None)
    assert str(out["version"]) == "isthmus"
    assert out["y"].tolist() == [1, 2, 3]
    assert "before the first jax computation" in str(out["second"])


def test_pathwaysutils_initialize_with_environment_variables(server):
    pytest.importorskip("pathwaysutils")
    compare("""
        import pathwaysutils
        pathwaysutils.initialize()
        import jax, jax.numpy as jnp
        if jax.config.jax_platforms == "proxy":
            from jax._src import xla_bridge
            factory = xla_bridge._backend_factories["proxy"].factory
            assert factory.__module__.startswith("pathwaysutils"), factory.__module__
            assert pathwaysutils.is_pathways_backend_used()
        emit("x", jax.jit(lambda a: jnp.cumsum(a) * 2)(np.arange(10.0, dtype=np.float32)))
    """, server.address)


_WAKE_UPS = """
    import ctypes, os, time
    {setup}
    import jax
    emit("y", jax.jit(lambda a: a * 2)(np.arange(4.0, dtype=np.float32)))

    def switches():  # voluntary context switches of each thread: its sleeps that ended
        out = {{}}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{{tid}}/status") as f:
                    out[tid] = int(next(line for line in f
                                        if line.startswith("voluntary_ctxt")).split()[1])
            except (OSError, StopIteration):
                pass
        return out

    before = switches()
    time.sleep(1.0)  # the window counted: the client idles, its threads wake on their timers
    after = switches()
    emit("busiest", max(after[t] - before.get(t, 0) for t in after))
    emit("main_slack", ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))
"""


def test_the_clients_own_threads_sleep_with_a_coarse_timer_slack():
    # The stock client's batcher thread wakes every 50 µs; created with a 1 ms timer slack
    # it wakes about a tenth as often (both through our backend factory and through
    # pathwaysutils'), and the user's threads keep the default slack.
    env = {k: v for k, v in os.environ.items() if k != "ISTHMUS_CLIENT_TIMER_SLACK_US"}
    with LocalServer(devices=2) as server:
        off = run_snippet(_WAKE_UPS.format(setup=""), server.address,
                          env={**env, "ISTHMUS_CLIENT_TIMER_SLACK_US": "0"})
        ours = run_snippet(_WAKE_UPS.format(setup=""), server.address, env=env)
        theirs = run_snippet(_WAKE_UPS.format(
            setup="import pathwaysutils; pathwaysutils.initialize()"), server.address, env=env)
    print("wake-ups of the busiest client thread in 1 s: slack off", off["busiest"], "ours",
          ours["busiest"], "pathwaysutils'", theirs["busiest"])
    for out in (off, ours, theirs):
        assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
        assert int(out["main_slack"]) == 50_000  # Linux's default, untouched
    assert int(off["busiest"]) > 2 * int(ours["busiest"]), (off["busiest"], ours["busiest"])
    assert int(off["busiest"]) > 2 * int(theirs["busiest"]), (off["busiest"], theirs["busiest"])


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_cuda_where_there_is_none_is_one_clear_line():
    from isthmus.worker.platforms import EXIT_PLATFORM_UNAVAILABLE, cuda_plugin_installed

    if cuda_plugin_installed():
        pytest.skip("jax's CUDA plugin is installed here")
    for args in (["up", "--devices", "2", "--platform", "cuda"],
                 ["up", "--platform", "cuda"],
                 ["run", "--platform", "cuda", "--", sys.executable, "-c", "pass"]):
        result = _isthmus(*args, timeout=120)
        assert result.returncode == 1, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "CUDA was asked for" in lines[0], (args, result.stderr)
        assert "--platform cpu" in lines[0]
    # A worker started by hand says it once and exits with the code launchers do not retry.
    worker = _isthmus("worker", "--controller", "127.0.0.1:9", "--platform", "cuda",
                      timeout=120)
    assert worker.returncode == EXIT_PLATFORM_UNAVAILABLE, worker.stderr
    lines = worker.stderr.strip().splitlines()
    assert len(lines) == 1 and "isthmus[cuda12]" in lines[0], worker.stderr
    # `auto` finds no GPU here and serves the CPU.
    out = subprocess.run(
        [sys.executable, "-m", "isthmus.cli", "run", "--platform", "auto", "--devices", "2",
         "--", sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_workers_find_a_fixed_fleet_port_through_the_controller_port():
    import socket

    port = free_port()
    with LocalServer(devices=None, fleet=(1, 1, 1), args=["--fleet-port", str(port)]) as server:
        # The ready line came after the worker registered, on that port.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert server.worker_pids(0), server.status()
        from isthmus.testing import run_python

        result = run_python("import jax, numpy as np\n"
                            "print(float(jax.jit(lambda x: x.sum())(np.arange(4.0))))",
                            server.address)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == "6.0", result.stdout


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_counts_below_one_are_one_line():
    for flag in ("--slices", "--hosts-per-slice", "--devices-per-host", "--devices"):
        result = _isthmus("up", flag, "0", timeout=60)
        assert result.returncode == 2, (flag, result.stderr)
        assert result.stderr.strip().splitlines() == [
            f"isthmus: {flag} must be at least 1, not 0"], result.stderr


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_shared_dir_is_checked_and_off_turns_it_off(tmp_path):
    missing = tmp_path / "nowhere"
    result = _isthmus("up", "--devices", "1", "--shared-dir", str(missing), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"isthmus: --shared-dir {missing}: no such directory; give an existing directory, "
        "'auto' (a fresh one under /dev/shm) or 'none'"], result.stderr
    # 'off' is 'none': the client gets no shared directory, and a put above the threshold
    # goes over the socket.
    script = ("import os, jax, numpy as np\n"
              "assert 'IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY' not in os.environ\n"
              "x = np.arange(1 << 20, dtype=np.float32)\n"
              "print(float(np.asarray(jax.device_put(x) * 2).sum()))\n")
    result = _isthmus("run", "--devices", "1", "--shared-dir", "off", "--", sys.executable,
                      "-c", script, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) == float((np.arange(1 << 20) * 2.0).sum())



@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_a_worker_waits_for_its_controller_then_says_why_it_gives_up():
    import time

    began = time.monotonic()
    result = _isthmus("worker", "--controller", f"127.0.0.1:{free_port()}", "--devices", "1",
                      "--connect-timeout", "2", timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert time.monotonic() - began >= 2
    lines = [line for line in result.stderr.splitlines() if "cannot reach" in line]
    assert len(lines) == 1 and "within 2 s" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_a_worker_started_first_waits_for_its_controller():
    import socket

    port = free_port()
    # Something listens on the controller's port first, to see the worker try it.
    stand_in = socket.create_server(("127.0.0.1", port))
    stand_in.settimeout(60)
    log = tempfile.TemporaryFile(mode="w+")
    worker = subprocess.Popen([sys.executable, "-m", "isthmus.cli", "worker", "--controller",
                               f"127.0.0.1:{port}", "--devices", "1", "--connect-timeout", "60",
                               "--log-level", "INFO"],
                              stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        try:
            attempt, _ = stand_in.accept()  # the worker is up and tried its controller
        finally:
            stand_in.close()
        attempt.close()  # ... and is refused: it must wait for the real one
        with LocalServer(devices=None, fleet=(1, 1, 1), args=["--no-launch", "--port", str(port)],
                         start_timeout=120) as server:
            # Its ready line means the worker registered with it.
            result = subprocess.run(
                [sys.executable, "-c", "import jax, numpy as np; "
                 "print(float(jax.jit(lambda x: x.sum())(np.arange(3.0))))"],
                env={**os.environ, **_client_env(server.address)}, capture_output=True,
                text=True, timeout=120)
            assert result.stdout.strip().splitlines()[-1] == "3.0", result.stderr[-2000:]
        assert worker.wait(30) == 0  # told to shut down by its controller
    except BaseException:
        log.seek(0)
        print("worker log:", log.read()[-4000:])
        raise
    finally:
        if worker.poll() is None:
            worker.kill()


def _client_env(address):
    from isthmus.serve import child_environment

    return child_environment(address, {k: v for k, v in os.environ.items()
                                       if k not in ("JAX_PLATFORMS", "XLA_FLAGS")})


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_a_port_in_use_is_one_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, flag in ((["--devices", "1", "--port", str(port)], "--port"),
                           (["--slices", "1", "--hosts-per-slice", "1", "--devices-per-host",
                             "1", "--fleet-port", str(port)], "--fleet-port")):
            result = _isthmus("up", *args, timeout=60)
            assert result.returncode == 2, (args, result.stderr[-2000:])
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and f"pick another {flag}" in lines[0], result.stderr


@pytest.mark.one_environment  # `isthmus run`'s environment: one environment runs it (19-32 s)
def test_run_gives_its_command_the_allocator_that_keeps_transfer_memory():
    from isthmus.hostmem import CLIENT_TUNABLES, client_allocator_environment

    # The rule, in process: the user's own GLIBC_TUNABLES, or glibc's defaults on request.
    assert client_allocator_environment({}) == {"GLIBC_TUNABLES": CLIENT_TUNABLES}
    assert client_allocator_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}
    assert client_allocator_environment({"ISTHMUS_CLIENT_MALLOC": "default"}) == {}
    # Through `isthmus run`: the command gets it, and a large put and fetch come back whole.
    script = ("import os, sys, jax, numpy as np\n"
              "print(os.environ.get('GLIBC_TUNABLES', '-'))\n"
              "x = np.arange(8 << 20, dtype=np.float32)\n"
              "for _ in range(2):\n"
              "    assert np.array_equal(np.asarray(jax.device_put(x)), x)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "ISTHMUS_CLIENT_MALLOC")}
    for extra, want in (({}, CLIENT_TUNABLES),
                        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                         "glibc.malloc.arena_max=2"),
                        ({"ISTHMUS_CLIENT_MALLOC": "default"}, "-")):
        result = _isthmus("run", "--devices", "1", "--", sys.executable, "-c", script,
                          timeout=120, env={**env, **extra})
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == want, (extra, result.stdout)


@pytest.mark.one_environment  # the server's own code: one environment runs it
def test_status_shows_a_buffers_moves_and_what_caused_them():
    """`isthmus status --buffer ID` (and `--array SESSION:HANDLE`): each move of the buffer
    with the request that caused it; bad queries get one line and exit 2."""
    server = LocalServer(devices=1)
    address = server.start()
    try:
        out = run_snippet(f"""
            import subprocess, sys
            import jax
            from isthmus.wire.servicer import fetch_status
            x = jax.device_put(np.arange(4.0, dtype=np.float32))
            y = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
            y.block_until_ready()
            def status(*args):
                r = subprocess.run([sys.executable, "-m", "isthmus.cli", "status",
                                    "--controller", "{address}", *args],
                                   capture_output=True, text=True, timeout=60)
                return f"{{r.returncode}}\\n{{r.stdout}}{{r.stderr}}"
            emit("put", status("--buffer", "1"))
            [session] = fetch_status("{address}")["sessions"]
            emit("array", status("--array", f"{{session}}:1"))  # x: the stock client's first
            emit("no_session", status("--array", "999:1"))
            emit("bad_array", status("--array", "one"))
            emit("y", y)
        """, address)
    finally:
        server.stop()
    assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
    code, *lines = str(out["put"]).splitlines()
    assert code == "0", lines
    # Made by the put, stored (its worker's answer), consumed by the donating run (x is
    # still held by the client: not freed yet); each move names its request.
    assert lines[0].startswith("buffer 1: deleted now; its last 3 moves"), lines
    assert "made pending" in lines[1], lines
    assert "make_array_from_host_buffer_request (op" in lines[1], lines
    assert "-> stored" in lines[2] and "no request" in lines[2], lines
    assert "stored -> deleted" in lines[3], lines
    assert "loaded_executable_execute_request (op" in lines[3], lines
    code, *lines = str(out["array"]).splitlines()
    assert code == "0" and lines[0] == "array 1 of session 1: deleted, 1 buffers", lines
    assert lines[1].startswith("buffer 1: deleted now") and len(lines) == 5, lines
    assert str(out["no_session"]).startswith("2\n") and "no open session 999" in str(
        out["no_session"])
    assert "SESSION:HANDLE" in str(out["bad_array"])
