"""Crash records and refused programs: a worker process that a program crashed (a real
segmentation fault, in a subprocess) leaves a record its successor reports, a process killed
from outside leaves none, and the controller refuses the reported program everywhere."""

import asyncio
import logging
import signal
import subprocess
import sys
import time
import types

import pytest

from isthmus import errors
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import WholeFleet
from isthmus.controller.manager import FleetManager, FleetSpec
from isthmus.launch import RestartPolicy
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.records import CompileRequest
from isthmus.worker.crashes import CrashConfig, CrashRecord, fatal_line

# A worker process in miniature: arms the records, joins controller 77, marks program 5,
# and then (by its second argument) crashes, returns from the dispatch, or waits to be killed.
WORKER = """
import sys, time
from isthmus.worker.crashes import CrashConfig, CrashRecord
record = CrashRecord(CrashConfig(sys.argv[1], test_crash_program="crash_me"))
assert record.take() is None
record.arm()
record.joined(77)
record.compiled(5, "jit_crash_me")
record.compiled(6, "jit_fine")
how = sys.argv[2]
if how == "segfault":
    record.running(5)  # the testing aid: a real segmentation fault
elif how == "returned":
    record.running(6)
    record.running(0)
    sys.exit(0)
elif how == "abort-after":
    record.running(6)
    record.running(0)
    import os; os.abort()
elif how == "other-thread":  # a fatal signal from another thread while a dispatch waits
    import os, threading
    record.running(6)
    threading.Thread(target=os.abort).start()
    time.sleep(60)
else:
    record.running(6)
    print("marked", flush=True)
    time.sleep(60)
"""


def _run_worker(tmp_path, how):
    path = str(tmp_path / "slot-0")
    process = subprocess.Popen([sys.executable, "-c", WORKER, path, how],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if how == "killed":
        assert process.stdout.readline() == "marked\n"
        process.send_signal(signal.SIGKILL)
    process.wait(60)
    return path, process


def test_a_program_that_segfaults_is_named_by_the_next_process_of_the_slot(tmp_path, caplog):
    path, process = _run_worker(tmp_path, "segfault")
    assert process.returncode == -signal.SIGSEGV, process.stderr
    caplog.set_level(logging.WARNING, logger="isthmus.worker.crashes")
    report = CrashRecord(CrashConfig(path)).take()
    assert report == m.CrashReport(77, 5, process.pid, "Fatal Python error: Segmentation fault")
    assert "Segmentation fault" in caplog.text and "executable 5" in caplog.text
    assert CrashRecord(CrashConfig(path)).take() is None  # the records were cleared
    assert not (tmp_path / "slot-0.fatal").exists()


@pytest.mark.parametrize("how", ["killed", "returned"])
def test_a_killed_or_clean_process_blames_nothing(tmp_path, how):
    path, process = _run_worker(tmp_path, how)
    assert process.returncode == (-signal.SIGKILL if how == "killed" else 0), process.stderr
    assert CrashRecord(CrashConfig(path)).take() is None


@pytest.mark.parametrize("how", ["abort-after", "other-thread"])
def test_a_fatal_signal_outside_a_dispatch_names_no_program(tmp_path, how):
    path, process = _run_worker(tmp_path, how)
    assert process.returncode == -signal.SIGABRT
    report = CrashRecord(CrashConfig(path)).take()
    assert report is not None and report.executable == 0
    assert report.fatal == "Fatal Python error: Aborted"


def test_without_a_record_path_nothing_is_kept(tmp_path):
    record = CrashRecord(CrashConfig())
    assert record.take() is None
    record.arm()
    record.joined(1)
    record.running(3)  # a no-op
    record.running(0)
    assert list(tmp_path.iterdir()) == []


def test_the_marker_costs_well_under_a_microsecond(tmp_path):
    record = CrashRecord(CrashConfig(str(tmp_path / "slot")))
    record.arm()
    running = record.running
    start = time.perf_counter()
    for i in range(100_000):
        running(i)
    per_call = (time.perf_counter() - start) / 100_000
    assert per_call < 2e-6, per_call  # about 0.1 µs; generous for a busy machine
    assert (tmp_path / "slot.program").read_bytes()[8:16] == (99_999).to_bytes(8, "little")


def test_fatal_line_and_the_report_travel_in_register():
    assert fatal_line("\nFatal Python error: Aborted\n\nThread 0x1:\n") == (
        "Fatal Python error: Aborted")
    register = m.Register(m.PROTOCOL_VERSION, 0, 2, "cpu", "cpu", "a:1", "host", 9,
                          crash=m.CrashReport(3, 4, 5, "Fatal Python error: Aborted"))
    assert m.decode(m.encode(register)) == register
    refuse = c.Refuse(4, (0, 1), errors.ProgramRefused("no"))
    back = m.decode(m.encode(refuse))
    assert isinstance(back.error, errors.ProgramRefused) and back.device_ids == (0, 1)
    assert back.error.code == errors.Code.FAILED_PRECONDITION


# ---- the controller ------------------------------------------------------------------------

def _register(slice_index, pid, crash=None):
    return m.Register(m.PROTOCOL_VERSION, slice_index, 2, "cpu", "cpu", "127.0.0.1:1",
                      "host", pid, crash=crash)


def _fleet():
    """A controller and manager with the workers of two one-host slices as members; returns
    them and, per slot, the frames sent to its worker."""
    fleet = WholeFleet([], {})
    controller = Controller(fleet)
    manager = FleetManager(FleetSpec(slices=2, hosts_per_slice=1, devices_per_host=2), fleet,
                           on_slice_down=controller.ledger.poison_slice,
                           on_crash=controller.crashed, last_program=controller.last_program)
    frames = {0: [], 1: []}
    for s in (0, 1):
        worker = manager.register(_register(s, 10 + s), frames[s].append, "peer")
        manager.members[worker.slot] = worker
        fleet.mark_up(s)
    fleet.members = set(manager.members)
    return fleet, controller, manager, frames


def _commands(frames):
    """The commands in the frames sent to a worker (shared ones decoded in place)."""
    out = []
    for frame in frames:
        for command in m.decode(frame).commands:
            out.extend(m.decode(command.data) if isinstance(command, m.Shared) else [command])
    return out


async def _compiled(fleet, frames, *executables):
    """Answers the workers' Compile requests, so that the executables are compiled."""
    await asyncio.sleep(0)  # the compile tasks send their requests
    await asyncio.sleep(0)
    for slot, sent in frames.items():
        for command in _commands(sent):
            if isinstance(command, m.Ask) and isinstance(command.command, c.Compile):
                fleet.workers[slot].on_message(m.Reply(command.request))
    for executable in executables:
        await executable.compiled


def _program(controller, fleet, device_ids, module=b"module crash_me"):
    request = CompileRequest(module, b"options", tuple(device_ids))
    info = types.SimpleNamespace(  # what the controller reads of a program with no arguments
        name="jit_crash_me" if b"crash" in module else "jit_fine", params=(), outputs=(),
        param_shardings=None, output_shardings=None, param_memory_kinds=(),
        output_memory_kinds=())
    return controller.executable(request, fleet.devices_of(device_ids), info)


def test_a_reported_crash_refuses_the_program_on_every_device(caplog):
    async def main():
        fleet, controller, manager, frames = _fleet()
        on_slice0 = _program(controller, fleet, (0, 1))
        on_slice1 = _program(controller, fleet, (2, 3))
        fine = _program(controller, fleet, (0, 1), b"module fine")
        await _compiled(fleet, frames, on_slice0, on_slice1, fine)
        controller.ensure_loaded(fine)
        controller.ensure_loaded(on_slice0)
        # The worker of slice 0 is lost while dispatching: its error names the program.
        manager.lost(fleet.workers[0], "its connection to the controller closed")
        error = fleet.slice_error(0)
        assert isinstance(error, errors.WorkerLost)
        assert "the last program it was given was jit_crash_me" in error.message
        # Its successor reports the crash: the program is refused, and said so once.
        caplog.set_level(logging.WARNING, logger="isthmus.controller.controller")
        report = m.CrashReport(manager.incarnation, on_slice0.id, 10,
                               "Fatal Python error: Segmentation fault")
        frames[0].clear()
        successor = manager.register(_register(0, 20, report), frames[0].append, "peer")
        warnings = [r.getMessage() for r in caplog.records
                    if r.name == "isthmus.controller.controller"]
        assert len(warnings) == 1 and "jit_crash_me" in warnings[0], warnings
        with pytest.raises(errors.ProgramRefused) as refused:
            _program(controller, fleet, (2, 3))  # Compile of it, even on other devices
        message = refused.value.message
        assert refused.value.code == errors.Code.FAILED_PRECONDITION
        assert "program jit_crash_me crashed worker host:10 (slice 0, host 0)" in message
        assert "Segmentation fault" in message and "until its controller restarts" in message
        # The executable on slice 1 is refused to its worker, once; Executes fail there.
        controller.ensure_loaded(on_slice1)
        await asyncio.sleep(0)
        [refusal] = [x for x in _commands(frames[1]) if isinstance(x, c.Refuse)]
        assert (refusal.executable, refusal.device_ids) == (on_slice1.id, (2, 3))
        assert isinstance(refusal.error, errors.ProgramRefused)
        assert refusal.error.message == message
        # Once the successor is a member, it is refused the program instead of given it.
        manager.members[0] = successor
        fleet.members = set(manager.members)
        controller.ensure_loaded(on_slice0)
        controller.ensure_loaded(fine)
        await asyncio.sleep(0)
        assert [type(x).__name__ for x in _commands(frames[0])] == ["Refuse", "Load"]
        # Other programs compile as before.
        other = _program(controller, fleet, (2, 3), b"module fine")
        await _compiled(fleet, frames, other)
    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_report_from_another_controller_or_of_no_program_refuses_nothing(caplog):
    async def main():
        fleet, controller, manager, frames = _fleet()
        executable = _program(controller, fleet, (0, 1))
        await _compiled(fleet, frames, executable)
        manager.lost(fleet.workers[0], "gone")
        caplog.set_level(logging.WARNING)
        manager.register(_register(0, 20, m.CrashReport(manager.incarnation + 1, executable.id,
                                                        10, "Fatal Python error: Aborted")),
                         lambda frame: None, "peer")
        assert "while serving another controller process" in caplog.text
        manager.lost(fleet.workers[0], "gone again")
        manager.register(_register(0, 21, m.CrashReport(manager.incarnation, 0, 20,
                                                        "Fatal Python error: Aborted")),
                         lambda frame: None, "peer")
        assert "outside any program" in caplog.text
        await _compiled(fleet, frames, _program(controller, fleet, (2, 3)))  # not refused
    asyncio.run(asyncio.wait_for(main(), 10))


def test_one_bad_program_costs_one_restart_and_the_count_resets():
    """With the program refused after the first crash, a slot sees one quick restart per
    distinct bad program; a worker that then lives `reset_after` starts the count afresh,
    so bad requests spread over time never use up `max_restarts`."""
    policy = RestartPolicy(max_restarts=3, reset_after=60.0)
    restarts = 0
    for _ in range(10):  # ten bad programs, each crashing a worker that had served an hour
        restarts = policy.attempt(restarts, lived=3600.0)
        assert restarts == 1 and policy.delay(restarts) == policy.initial_backoff
    # Crashes in quick succession (distinct programs, each refused after its crash) do count.
    assert [policy.delay(policy.attempt(n, lived=1.0)) for n in range(4)] == [
        0.5, 1.0, 2.0, None]
