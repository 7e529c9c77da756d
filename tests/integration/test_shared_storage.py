"""Each tenant's files in its own place, and profiles per lease, on a shared service.

A 3-slice CPU fleet whose tenants file gives alice and bob storage roots and carol none.
Tenants persist with pathwaysutils' persistence API and profile with its `profileRequest`
plugin program, from the stock jax client in subprocesses through their leases' tunnels,
the way an attacker would try it: bob names alice's checkpoint by absolute path, by
`../alice/...` and by `file://`; profiles aim at `..`, other directories and other schemes
(nothing may connect to a host a tenant names); two tenants profile at once; a profile
without a duration stops at the service's cap (on a 1-slice service of its own, whose cap is
short). Values are compared with numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from isthmus.profiling import SUFFIX, host_name
from isthmus.testing import child_environment, run_python, wait_until
from tests.integration.shared_service import SharedService

pytestmark = pytest.mark.one_environment  # the server's own code: one environment runs it

PROFILE_CAP = 2  # the capped service's max_profile_seconds (the other's: the default)

CLIENT = """
import datetime, json, sys
import jax, numpy as np
import pathwaysutils
pathwaysutils.initialize()
from jax.extend import backend, ifrt_programs
from jax.interpreters import pxla
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pathwaysutils.persistence import helper

mesh = Mesh(np.array(jax.devices()), ("x",))
sharding = NamedSharding(mesh, P("x"))
timeout = datetime.timedelta(seconds=60)
client = jax.devices()[0].client
programs = ifrt_programs.ifrt_programs
avals = [jax.core.ShapedArray((1,), np.object_)]
default = [jax.sharding.SingleDeviceSharding(backend.get_default_device())]

def plugin(body):
    return client.compile_ifrt_program(programs.make_plugin_program(json.dumps(body)),
                                       programs.make_plugin_compile_options())

def call(executable):
    results = executable.execute_sharded([], with_tokens=True)
    outs = results.consume_with_handlers(
        pxla.global_avals_to_results_handler(avals, default, True).handlers)
    results.consume_token().block_until_ready()
    return str(np.asarray(outs[0])[0])

def profile(location, run, duration=None):
    body = {"traceLocation": location, "maxNumHosts": 8, "includeResourceManagers": True,
            "xprofTraceOptions": {"traceDirectory": location, "traceSessionName": run}}
    if duration is not None:
        body["maxDurationSecs"] = duration
    return plugin({"profileRequest": body})

@jax.jit
def profiled_tenant_step(a):
    return a * 2 + 1

def step():
    x = jax.device_put(np.arange(8.0, dtype=np.float32), sharding)
    np.testing.assert_allclose(np.asarray(profiled_tenant_step(x)), np.arange(8.0) * 2 + 1)

def run(op):
    kind = op[0]
    if kind == "write":
        _, location, name, value = op
        array = jax.device_put(np.full((4,), value, np.int32), sharding)
        helper.write_arrays(location, [name], [array], timeout).result()
        return "written"
    if kind == "read":
        _, location, name = op
        arrays, done = helper.read_arrays(location, [name], [np.dtype(np.int32)], [(4,)],
                                          [sharding], list(mesh.devices.flat), timeout)
        done.result()
        return str(np.asarray(arrays[0]).tolist())
    if kind == "profile":  # start, run a step, stop: the run directory
        _, location, run_name = op
        executable = profile(location, run_name)
        where = call(executable)
        step()
        call(executable)
        return where
    if kind == "secret":  # a program whose name must not reach another tenant's profile
        @jax.jit
        def bobs_secret_program(a):
            return a * 3 - 1
        x = jax.device_put(np.arange(8.0, dtype=np.float32), sharding)
        return str(np.asarray(bobs_secret_program(x)).tolist())
    if kind == "profile_compile":
        profile(op[1], "refused")
        return "compiled"
    raise ValueError(kind)

for i, op in enumerate(json.loads(sys.argv[1])):
    try:
        outcome = "OK " + run(op)
    except Exception as e:  # noqa: BLE001
        outcome = "ERR " + " ".join(str(e).split())
    print("RESULT", i, outcome, flush=True)
"""

# A profile that starts when the test says so and stops when it says so (flag files).
HELD_PROFILE = CLIENT.split("for i, op in")[0] + """
import os, time
location, run_name, start_flag, stop_flag, duration = sys.argv[1:6]
def wait_for(path):
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.02)
executable = profile(location, run_name, None if duration == "none" else float(duration))
step()
print("READY", flush=True)
wait_for(start_flag)
try:
    print("STARTED", call(executable), flush=True)
except Exception as e:  # noqa: BLE001
    print("REFUSED", " ".join(str(e).split()), flush=True)
    sys.exit(0)
step()
wait_for(stop_flag)
print("STOPPED", call(executable), flush=True)
"""


def _storage_roots(directory, names):
    roots = {name: directory / "files" / name for name in names}
    for root in roots.values():
        root.mkdir(parents=True)
    return roots


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    roots = _storage_roots(directory, ("alice", "bob"))
    socket_path = directory / "service.sock"
    with SharedService(directory, (3, 1, 2), {
            "alice": {"max_slices": 2, "storage_root": "files/alice"},
            "bob": {"max_slices": 1, "priority": 5, "storage_root": str(roots["bob"])},
            "carol": {"max_slices": 1}}, args=[
                "--unix-socket", str(socket_path), "--allow-plain-connect",
                "--log-format", "json"]) as server:
        server.roots = roots
        yield server


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """A 1-slice service whose profiles stop by themselves after PROFILE_CAP seconds (the
    other tests hold profiles longer than that)."""
    directory = tmp_path_factory.mktemp("capped")
    roots = _storage_roots(directory, ("alice",))
    with SharedService(directory, (1, 1, 1),
                       {"alice": {"max_slices": 1, "storage_root": "files/alice"}},
                       {"max_profile_seconds": PROFILE_CAP}) as server:
        server.roots = roots
        yield server


def outcomes(grant, ops):
    """What each operation of `ops` came to in a client of `grant`: "OK ..." or "ERR ..."."""
    result = run_python(CLIENT, grant.target, timeout=240, args=[json.dumps(ops)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = [line.split(" ", 2) for line in result.stdout.splitlines()
             if line.startswith("RESULT ")]
    assert [int(n) for _, n, _ in lines] == list(range(len(ops))), result.stdout
    return [text for _, _, text in lines]


def refused(outcome, root):
    return (outcome.startswith("ERR") and "PERMISSION_DENIED" in outcome
            and f"outside this tenant's storage root {root}" in outcome)


def test_bob_can_neither_read_nor_overwrite_alices_checkpoint(service):
    alice_root, bob_root = service.roots["alice"], service.roots["bob"]
    with service.lease("alice") as alice, service.lease("bob") as bob:
        # A relative name lands in alice's root, written by her lease's workers.
        assert outcomes(alice, [["write", "ckpt", "w", 4242]]) == ["OK written"]
        saved = alice_root / "ckpt" / "w"
        assert json.loads((saved / "meta.json").read_text())["shape"] == [4]
        assert len(list(saved.glob("shard-*.npy"))) == 2
        assert np.load(saved / "shard-0-2.npy").tolist() == [4242, 4242]
        # Bob names it every way an attacker would: each is refused, naming his root.
        ways = [str(alice_root / "ckpt"), "../alice/ckpt", f"file://{alice_root}/ckpt",
                f"{bob_root}/../alice/ckpt", "ckpt/../../alice/ckpt"]
        got = outcomes(bob, [["read", way, "w"] for way in ways] +
                       [["write", way, "w", 666] for way in ways] +
                       [["write", "ckpt", "w", 7], ["read", "ckpt", "w"]])
        for way, outcome in zip(ways + ways, got):
            assert refused(outcome, bob_root), (way, outcome)
        # His own relative "ckpt" is his: alice's is untouched, and she reads her value.
        assert got[-2:] == ["OK written", "OK [7, 7, 7, 7]"]
        assert np.load(bob_root / "ckpt" / "w" / "shard-0-2.npy").tolist() == [7, 7]
        assert outcomes(alice, [["read", "ckpt", "w"], ["read", str(saved.parent), "w"]]) == [
            "OK [4242, 4242, 4242, 4242]"] * 2
    assert np.load(saved / "shard-2-4.npy").tolist() == [4242, 4242]


def test_a_tenant_without_a_storage_root_cannot_persist_or_profile(service, tmp_path):
    with service.lease("carol") as carol:
        got = outcomes(carol, [["write", "ckpt", "w", 1],
                               ["write", str(tmp_path / "ckpt"), "w", 1],
                               ["read", str(tmp_path / "ckpt"), "w"],
                               ["profile_compile", str(tmp_path / "profile")]])
    for outcome in got:
        assert outcome.startswith("ERR") and "PERMISSION_DENIED" in outcome, outcome
        assert "tenant carol has no storage root" in outcome, outcome
        assert 'storage_root = "/DIR"' in outcome and "[tenants.carol]" in outcome, outcome
    assert not any(tmp_path.iterdir())


def test_profiles_outside_the_root_and_foreign_schemes_are_refused(service, tmp_path):
    alice_root = service.roots["alice"]
    ways = ["../bob/profile", str(tmp_path / "profile"), f"file://{tmp_path}/profile",
            "/tmp", "ftp://127.0.0.1:9/profile", "webhdfs://127.0.0.1:9/profile",
            "http://127.0.0.1:9/profile", "gs://bucket/alice", "memory://profile",
            "simplecache::file:///tmp/profile"]
    with service.lease("alice") as alice:
        got = outcomes(alice, [["profile_compile", way] for way in ways])
    for way, outcome in zip(ways, got):
        assert refused(outcome, alice_root), (way, outcome)
    assert not any(tmp_path.iterdir()) and not (service.roots["bob"] / "profile").exists()


def _held(grant, location, run, flags, duration="none"):
    """A client of `grant` holding a profile: READY, then STARTED once `flags/start` exists,
    then STOPPED once `flags/stop` exists."""
    script = flags / f"held_{run}_{duration}.py"
    script.write_text(HELD_PROFILE)
    return subprocess.Popen(
        [sys.executable, script, location, run, flags / "start", flags / "stop", duration],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_environment(grant.target, dict(os.environ)))


def _line(process, prefix):
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(prefix):
        process.kill()
        raise AssertionError(f"wanted {prefix!r}, got {line!r}: {process.stderr.read()[-3000:]}")
    return line.split(" ", 1)[1].strip() if " " in line else ""


def _run_files(root, run):
    directory = root / "plugins" / "profile" / run
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_two_tenants_profile_their_own_leases_at_once(service, tmp_path):
    with service.lease("alice") as alice, service.lease("bob") as bob:
        clients = {"alice": _held(alice, "prof", "together", tmp_path),
                   "bob": _held(bob, "prof", "together", tmp_path, "600")}
        try:
            for process in clients.values():
                _line(process, "READY")
            (tmp_path / "start").touch()
            where = {who: _line(process, "STARTED") for who, process in clients.items()}
            (tmp_path / "stop").touch()
            for who, process in clients.items():
                assert _line(process, "STOPPED") == where[who]
                assert process.wait(60) == 0, process.stderr.read()[-3000:]
        finally:
            for process in clients.values():
                process.kill()
                process.wait()
        for who, grant in (("alice", alice), ("bob", bob)):
            root = service.roots[who]
            assert where[who] == f"{root}/prof/plugins/profile/together"
            # Its own lease's worker only: no other slice's, and not the controller's.
            (own,) = grant.slices
            assert _run_files(root / "prof", "together") == [
                host_name(f"slice{own}-host0") + SUFFIX]
            data = (root / "prof" / "plugins" / "profile" / "together" /
                    (host_name(f"slice{own}-host0") + SUFFIX)).read_bytes()
            assert b"jit_profiled_tenant_step" in data


def test_a_profile_without_a_duration_stops_at_the_services_cap(capped, tmp_path):
    root = capped.roots["alice"]
    with capped.lease("alice") as alice:
        client = _held(alice, "capped", "cap", tmp_path)
        try:
            _line(client, "READY")
            (tmp_path / "start").touch()
            assert _line(client, "STARTED") == f"{root}/capped/plugins/profile/cap"
            started = time.monotonic()
            # Never stopped by its client: written once the cap has passed, not before.
            (own,) = alice.slices
            wait_until(lambda: _run_files(root / "capped", "cap"), PROFILE_CAP + 60,
                       "the capped profile to be written")
            assert time.monotonic() - started >= PROFILE_CAP / 2
            assert _run_files(root / "capped", "cap") == [
                host_name(f"slice{own}-host0") + SUFFIX]
            (tmp_path / "stop").touch()  # the stop then finds it done
            assert _line(client, "STOPPED") == f"{root}/capped/plugins/profile/cap"
            assert client.wait(60) == 0, client.stderr.read()[-3000:]
        finally:
            client.kill()
            client.wait()


def test_a_reclaimed_slice_leaves_its_leases_profile_before_another_lease_runs(service,
                                                                              tmp_path):
    """alice profiles her elastic 2-slice lease; bob (priority 5) reclaims one of its slices
    and runs a program there: alice's profile is written without that slice's host, and
    nothing of bob's program is in it."""
    root = service.roots["alice"]
    with service.lease("carol"), service.lease("alice", slices=2, elastic=True) as alice:
        client = _held(alice, "elastic", "reclaim", tmp_path)
        try:
            _line(client, "READY")
            (tmp_path / "start").touch()
            assert _line(client, "STARTED") == f"{root}/elastic/plugins/profile/reclaim"
            with service.lease("bob") as bob:
                (taken,) = bob.slices
                assert taken in alice.slices
                assert outcomes(bob, [["secret"]]) == [
                    "OK " + str((np.arange(8.0) * 3 - 1).tolist())]
            # alice's profile was still being taken while bob ran (it is written at its stop).
            assert _run_files(root / "elastic", "reclaim") == []
            (tmp_path / "stop").touch()
            _line(client, "STOPPED")
            assert client.wait(60) == 0, client.stderr.read()[-3000:]
        finally:
            client.kill()
            client.wait()
    (kept,) = set(alice.slices) - {taken}
    assert _run_files(root / "elastic", "reclaim") == [host_name(f"slice{kept}-host0") + SUFFIX]
    for path in root.rglob("*"):
        assert not path.is_file() or b"bobs_secret_program" not in path.read_bytes(), path
