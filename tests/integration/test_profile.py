"""Profiles of every worker through pathwaysutils' `profileRequest` plugin program.

The stop of a profile writes one XProf trace per profiled host, and one of the controller,
as `LOG_DIR/plugins/profile/RUN/HOST.xplane.pb` (what TensorBoard's profile plugin and xprof
open), holding the XLA ops of the programs the client ran in between. pathwaysutils' own
`start_trace` accepts only gs:// locations: the slow test runs it, and `collect_profile`,
against a GCS emulator (gcp-storage-emulator, with gcsfs on the workers); the cheap one sends
the same plugin program by hand with a local directory.
"""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from isthmus import errors
from isthmus.frontend import profile
from isthmus.ports import free_port
from isthmus.profiling import SUFFIX, host_name
from isthmus.testing import LocalServer, run_python

STEP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

@jax.jit
def profiled_step_fn(x):
    return jnp.sin(x) * 2 + x.sum(axis=1, keepdims=True)

x = jax.device_put(np.ones((64, 64), np.float32),
                   NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x")))
want = np.sin(np.ones((64, 64))) * 2 + 64

def step():
    np.testing.assert_allclose(np.asarray(profiled_step_fn(x)), want, rtol=1e-5)
"""

BY_HAND = STEP + """
import json, sys
from jax.extend import backend, ifrt_programs
from jax.interpreters import pxla

# What pathwaysutils.plugin_executable.PluginExecutable does (without importing orbax).
programs, client = ifrt_programs.ifrt_programs, jax.devices()[0].client
def PluginExecutable(text):
    return client.compile_ifrt_program(programs.make_plugin_program(text),
                                       programs.make_plugin_compile_options())

log_dir = sys.argv[1]
def request(**fields):  # as pathwaysutils' start_trace builds it (jax >= 0.9.2)
    return json.dumps({"profileRequest": {
        "traceLocation": log_dir, "maxNumHosts": 8, "includeResourceManagers": True,
        "xprofTraceOptions": {"traceDirectory": log_dir, "traceSessionName": "by_hand"},
        **fields}})

avals = [jax.core.ShapedArray((1,), jnp.object_)]
shardings = [jax.sharding.SingleDeviceSharding(backend.get_default_device())]
def call(executable):
    results = executable.execute_sharded([], with_tokens=True)
    outs = results.consume_with_handlers(
        pxla.global_avals_to_results_handler(avals, shardings, True).handlers)
    results.consume_token().block_until_ready()
    return np.asarray(outs[0])

step()  # compiled before the profile: the profile shows it running
profile = PluginExecutable(request())
assert call(profile)[0] == f"{log_dir}/plugins/profile/by_hand", call  # started
try:
    call(PluginExecutable(request()))  # one profile of the fleet at a time
except Exception as e:
    assert "FAILED_PRECONDITION" in str(e) and "being taken already" in str(e), e
else:
    raise AssertionError("a second profile started")
step()
call(profile)  # stopped: the files are written
try:
    PluginExecutable(request(maxNumHosts=0))
except Exception as e:
    assert "INVALID_ARGUMENT" in str(e) and "maxNumHosts" in str(e), e
else:
    raise AssertionError("maxNumHosts=0 was accepted")
print("OK")
"""


TO_FTP = BY_HAND.split("step()  # compiled before")[0] + """
profile = PluginExecutable(request())
call(profile)  # started: nothing is written before the stop
try:
    call(profile)
except Exception as e:
    print("ERR", " ".join(str(e).split()))
else:
    print("WROTE")
"""


def test_a_profile_into_a_location_that_cannot_be_written_fails_clearly(server):
    # An ftp:// server that hangs up at once: fsspec's FTP backend raises EOFError (once an
    # INTERNAL "this is a bug"); the stop says the location cannot be written.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def hang_up():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    location = f"ftp://127.0.0.1:{listener.getsockname()[1]}/profile"
    try:
        result = run_python(TO_FTP, server.address, timeout=120, args=[location])
    finally:
        listener.close()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("ERR")]
    assert "INVALID_ARGUMENT" in line and "INTERNAL" not in line and "bug" not in line, line
    assert f"cannot write the profile to '{location}/plugins/profile/by_hand/" in line, line
    assert "EOFError" in line and "pick a location every host can write to" in line, line


def _hosts(server):
    return ["slice0-host0"] if server.kind == "embedded" else [
        "slice0-host0", "slice0-host1", "slice1-host0", "slice1-host1"]


def test_a_profile_has_one_trace_per_host_with_the_programs_ops(server, tmp_path):
    result = run_python(BY_HAND, server.address, timeout=120, args=[str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "OK" in result.stdout
    run = tmp_path / "plugins" / "profile" / "by_hand"
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    want = {host_name(h) + SUFFIX for h in _hosts(server)}
    if server.kind == "fleet":  # the embedded host's process is the controller's
        want.add(host_name("controller") + SUFFIX)
    assert set(files) == want
    for host in _hosts(server):
        data = files[host_name(host) + SUFFIX]
        # The XLA program and its ops, as the worker's host tracer recorded them running.
        assert b"jit_profiled_step_fn" in data and b"sine" in data, host


def test_the_process_profiler_records_once_per_process_and_writes_xplanes(tmp_path):
    # jaxlib's ProfilerSession (a jax internal, `profiler._session`) as jax 0.10-0.12 have it.
    from isthmus.profiling import ProcessProfiler, write_trace
    from isthmus.transport.records import TraceOptions

    process = ProcessProfiler()
    assert process.start("a", TraceOptions(host_tracer_level=1)) is True
    assert process.start("a", TraceOptions()) is False  # an in-process host's controller
    assert process.stop("b") is None
    data = process.stop("a")
    assert isinstance(data, bytes) and data
    assert process.stop("a") is None
    path = write_trace(data, str(tmp_path / "run"), "h")
    assert (tmp_path / "run" / "h.xplane.pb").read_bytes() == data
    assert path == f"{tmp_path}/run/h.xplane.pb" and len(list((tmp_path / "run").iterdir())) == 1


def test_a_profile_stops_by_itself_when_its_time_or_its_session_ends(tmp_path):
    # The controller and an embedded host in this process: no sockets, no subprocess.
    from isthmus.controller.controller import Controller
    from isthmus.controller.session import Session
    from isthmus.head import embedded_fleet

    async def main():
        controller = Controller(embedded_fleet(2)[0])
        first, second = Session(controller), Session(controller)
        timed = first.profiles.compile(profile.plan_of(
            {"traceLocation": str(tmp_path / "timed"), "maxDurationSecs": 0.05,
             "xprofTraceOptions": {"traceSessionName": "t"}}))
        outputs, started = first.profiles.run(timed, [])
        await started()
        assert len(outputs) == 1 and outputs[0].dtype.is_string and outputs[0].shape == (1,)
        with pytest.raises(errors.ProfileRunning, match="being taken already"):
            second.profiles.run(second.profiles.compile(timed.request), [])
        # Past maxDurationSecs it is written without a stop; the stop then finds it done.
        await _appears(tmp_path / "timed" / "plugins" / "profile" / "t" / (
            host_name("slice0-host0") + SUFFIX))
        _, stopped = first.profiles.run(timed, [])
        await asyncio.wait_for(stopped(), 30)
        # A session that ends stops (and writes) the profile it started.
        left = second.profiles.compile(profile.plan_of(
            {"traceLocation": str(tmp_path / "left"),
             "xprofTraceOptions": {"traceSessionName": "l"}}))
        _, started = second.profiles.run(left, [])
        await started()
        await second.close()
        await _appears(tmp_path / "left" / "plugins" / "profile" / "l" / (
            host_name("slice0-host0") + SUFFIX))
        deadline = time.monotonic() + 30
        while controller.profiles:  # free for the next profile
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await first.close()

    asyncio.run(main())


async def _appears(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout} s"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("body, field", [
    ({"maxNumHosts": 2}, "traceLocation"),
    ({"traceLocation": "/tmp/p", "maxNumHosts": -1}, "maxNumHosts"),
    ({"traceLocation": "/tmp/p", "maxDurationSecs": 0}, "maxDurationSecs"),
    ({"traceLocation": "/tmp/p", "xprofTraceOptions": {"traceSessionName": "../up"}},
     "traceSessionName"),
    ({"traceLocation": "/tmp/p", "xprofTraceOptions": {"hostTraceLevel": 9}},
     "hostTraceLevel"),
    ({"traceLocation": "/tmp/p", "xprofTraceOptions": {"pwTraceOptions": {
        "advancedConfiguration": {"a": {"int64Value": "x"}}}}}, "advancedConfiguration"),
])
def test_a_malformed_profile_request_is_refused_naming_its_field(body, field):
    with pytest.raises(errors.InvalidRequest, match=field):
        profile.plan_of(body)


def test_a_profile_request_reads_what_pathwaysutils_sends():
    plan = profile.plan_of({
        "traceLocation": "gs://b/logs", "maxNumHosts": 4, "includeResourceManagers": True,
        "maxDurationSecs": 2.5,
        "xprofTraceOptions": {"traceDirectory": "gs://b/logs", "hostTraceLevel": 3,
                              "traceSessionName": "2026_01_02_03_04_05",
                              "pwTraceOptions": {"enablePythonTracer": True,
                                                 "advancedConfiguration": {
                                                     "a": {"boolValue": True},
                                                     "b": {"int64Value": "7"},
                                                     "c": {"stringValue": "s"}}}}})
    assert (plan.location, plan.max_hosts, plan.controller, plan.run, plan.output,
            plan.max_duration) == ("gs://b/logs", 4, True, "2026_01_02_03_04_05", True, 2.5)
    assert (plan.options.host_tracer_level, plan.options.python_tracer_level,
            plan.options.advanced) == (3, 1, (("a", True), ("b", 7), ("c", "s")))
    bare = profile.plan_of({"traceLocation": "gs://b/logs"})
    assert (bare.max_hosts, bare.controller, bare.run, bare.output) == (1, False, None, False)


# ---- pathwaysutils itself, into a GCS emulator, on a fleet of 2 x 2 x 2 -----------------------

PATHWAYSUTILS = """
import pathwaysutils
pathwaysutils.initialize()  # before jax makes its backend
""" + STEP + """
import sys, threading, socket, subprocess, time
import fsspec
from pathwaysutils import profiling
import jax._src.profiler as jax_profiler

local, port = sys.argv[1], int(sys.argv[2])
original_stop = profiling._original_stop_trace
def stop_here():
    # The client's own trace: jax exports it through its own GCS client, which cannot be
    # pointed at an emulator, so it goes to a local directory (the fleet's go to the bucket).
    state = jax_profiler._profile_state
    if getattr(state, "session", None) is not None:  # jax >= 0.11: a ProfileSession
        state.session.log_dir = local
    else:
        state.log_dir = local
    return original_stop()
profiling._original_stop_trace = stop_here

step()
with jax.profiler.trace("gs://prof/traced", max_num_hosts=4):
    step()
    step()

jax.profiler.start_server(port)  # pathwaysutils' profiling server, for collect_profile
deadline = time.monotonic() + 60
while True:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        break
    except OSError:
        assert time.monotonic() < deadline, "the profiling server did not start"
        time.sleep(0.1)
collected = []
collector = threading.Thread(target=lambda: collected.append(profiling.collect_profile(
    port, 1500, "127.0.0.1", "gs://prof/collected")))
collector.start()
while collector.is_alive():
    step()
collector.join()
assert collected == [True], collected
cli = subprocess.run([sys.executable, "-m", "pathwaysutils.collect_profile", "--log_dir",
                      "gs://prof/cli", str(port), "1000"], capture_output=True, text=True,
                     timeout=120)
assert cli.returncode == 0 and "Failed" not in cli.stderr, cli.stderr

fs = fsspec.filesystem("gs")
for run in ("traced", "collected", "cli"):
    found = sorted(fs.find(f"prof/{run}/plugins/profile"))
    print(run, [p.split("/", 4)[-1] for p in found])
    data = {p.rsplit("/", 1)[-1]: fs.cat(p) for p in found}
    workers = [n for n in data if "-slice" in n]
    assert len(workers) == (4 if run == "traced" else 1), sorted(data)  # maxNumHosts: 1
    if run != "cli":  # the steps ran while these were taken
        assert all(b"jit_profiled_step_fn" in data[n] for n in workers), sorted(data)
    assert any(n.endswith("-controller.xplane.pb") for n in data), sorted(data)
print("OK")
"""



@pytest.fixture
def gcs_emulator():
    """A GCS emulator with bucket `prof`; the environment that points gcsfs at it."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    port = free_port()
    emulator = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
         "--port", str(port), "--in-memory", "--default-bucket", "prof", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            if emulator.poll() is not None or time.monotonic() > deadline:
                emulator.kill()
                pytest.fail(f"the GCS emulator did not start: {emulator.communicate()[1]}")
            time.sleep(0.05)
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "FSSPEC_GS_TOKEN": "anon",  # fsspec's configuration: no credentials to look for
           # gcsfs's bucket-type probe speaks gRPC, which the emulator does not.
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    try:
        yield env
    finally:
        emulator.terminate()
        try:
            emulator.wait(10)
        except subprocess.TimeoutExpired:
            emulator.kill()
            emulator.wait(10)


@pytest.mark.slow
def test_pathwaysutils_profiles_a_fleet_into_gcs(gcs_emulator, tmp_path):
    with LocalServer(devices=None, fleet=(2, 2, 2), env=gcs_emulator) as server:
        result = run_python(PATHWAYSUTILS, server.address, timeout=300, env=gcs_emulator,
                            args=[str(tmp_path), str(free_port())])
        assert result.returncode == 0, (result.stdout + result.stderr[-4000:] +
                                        server.log()[-3000:])
    assert "OK" in result.stdout, result.stdout
    # The client's own trace (jax's, exported locally: see `stop_here`) is there too.
    assert list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))
