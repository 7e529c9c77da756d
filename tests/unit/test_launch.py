"""The local launcher's restarts, driven with stand-in commands instead of workers (no
controller, no sockets)."""

import logging
import os
import signal
import sys
import time

import pytest

from isthmus.cli import build_parser
from isthmus.launch import LocalLauncher, RestartPolicy, describe_exit
from isthmus.serve import head_config
from isthmus.testing import process_alive, wait_until

# Each start appends "<monotonic time> <pid>" to the file named by its first argument.
RECORD = ("import os, sys, time\n"
          "open(sys.argv[1], 'a').write(f'{time.monotonic()} {os.getpid()}\\n')\n")
FAIL = RECORD + "print('failing', flush=True); sys.exit(3)\n"
LIVE = RECORD + "time.sleep(60)\n"
STUBBORN = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            + RECORD + "time.sleep(60)\n")
FAST = dict(initial_backoff=0.05, max_backoff=0.2, poll_interval=0.02)


class FakeLauncher(LocalLauncher):
    """Runs `script` (with its record file as argument) in place of `isthmus worker`."""

    def __init__(self, tmp_path, script, policy, slices=1, hosts=1):
        super().__init__("127.0.0.1:1", slices, hosts, 2, log_dir=str(tmp_path / "logs"),
                         restart=policy)
        self.script = script
        self.tmp_path = tmp_path

    def record(self, slice_index):
        return self.tmp_path / f"starts-{slice_index}"

    def command(self, slice_index, host=0):
        return [sys.executable, "-S", "-c", self.script, str(self.record(slice_index))]

    def starts(self, slice_index=0):
        """(time, pid) of each start of a slice's workers, in order."""
        try:
            lines = self.record(slice_index).read_text().split()
        except FileNotFoundError:
            return []
        return [(float(t), int(p)) for t, p in zip(lines[::2], lines[1::2])]


# Longer than several of FAST's polls and its first backoff: time enough for a restart that
# must not come to show itself (these sleeps are the test, not synchronization).
GRACE = 0.3


@pytest.fixture
def launched():
    made = []
    yield made.append
    for launcher in made:
        launcher.stop(timeout=2.0)


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records
            if r.name == "isthmus.launch" and r.levelno == level]


def test_backoff_doubles_up_to_its_cap_and_ends_at_the_limit():
    policy = RestartPolicy()
    assert [policy.delay(n) for n in range(1, 11)] == [0.5, 1, 2, 4, 8, 8, 8, 8, 8, 8]
    assert policy.delay(11) is None
    assert policy.attempt(restarts=4, lived=3.0) == 5
    assert policy.attempt(restarts=10, lived=60.0) == 1  # lived long enough: afresh
    assert RestartPolicy(enabled=False).delay(1) is None
    assert RestartPolicy(max_restarts=0).delay(1) is None


@pytest.mark.parametrize("bad", [dict(max_restarts=-1), dict(initial_backoff=-1.0),
                                 dict(initial_backoff=9.0, max_backoff=8.0),
                                 dict(poll_interval=0.0)])
def test_a_policy_refuses_impossible_values(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


def test_exits_are_described_by_code_or_signal():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"


def test_a_dying_worker_is_restarted_with_backoff_until_the_limit(tmp_path, launched, caplog):
    caplog.set_level(logging.INFO, logger="isthmus.launch")
    launcher = FakeLauncher(tmp_path, FAIL, RestartPolicy(max_restarts=3, **FAST))
    launched(launcher)
    launcher.start()
    wait_until(lambda: messages(caplog, logging.ERROR), 10, "giving up the slot")
    time.sleep(GRACE)  # nothing more may start
    starts = launcher.starts()
    assert len(starts) == 4, starts  # the first start and 3 restarts
    assert len({pid for _, pid in starts}) == 4
    gaps = [b[0] - a[0] for a, b in zip(starts, starts[1:])]
    for gap, backoff in zip(gaps, [0.05, 0.1, 0.2]):
        assert gap >= backoff, (gaps, "a restart came before its backoff")
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) == 3, warnings
    for attempt, line in enumerate(warnings, 1):
        assert "(slice 0, host 0)" in line and "exit code 3" in line, line
        assert f"attempt {attempt} of 3" in line, line
    [error] = messages(caplog, logging.ERROR)
    assert "stays down" in error and "isthmus worker --controller 127.0.0.1:1 --slice 0 " \
        "--devices 2" in error, error
    log = (tmp_path / "logs" / "worker-s0-h0.log").read_text()
    assert log.count("failing") == 4 and "restart 3 of 3" in log, log  # one file, appended
    assert launcher.processes == []


def test_a_worker_that_lived_long_enough_starts_the_count_afresh(tmp_path, launched, caplog):
    caplog.set_level(logging.WARNING, logger="isthmus.launch")
    script = RECORD + "time.sleep(0.3); sys.exit(1)\n"  # lives past reset_after, then fails
    launcher = FakeLauncher(tmp_path, script, RestartPolicy(
        max_restarts=1, reset_after=0.2, **FAST))
    launched(launcher)
    launcher.start()
    wait_until(lambda: len(launcher.starts()) >= 3, 10, "two restarts")
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) >= 2 and all("attempt 1 of 1" in w for w in warnings), warnings
    assert not messages(caplog, logging.ERROR)


def test_a_killed_worker_is_replaced_and_stop_leaves_no_process(tmp_path, launched, caplog):
    caplog.set_level(logging.WARNING, logger="isthmus.launch")
    launcher = FakeLauncher(tmp_path, LIVE, RestartPolicy(**FAST), slices=2, hosts=2)
    launched(launcher)
    launcher.start()
    wait_until(lambda: len(launcher.starts(0)) == 2 and len(launcher.starts(1)) == 2, 10,
               "four starts")
    victim = launcher.starts(1)[0][1]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(launcher.starts(1)) == 3, 10, "the restart of slice 1")
    [warning] = messages(caplog, logging.WARNING)
    assert f"worker {victim} ended with signal SIGKILL" in warning, warning
    assert "(slice 1, host " in warning and "attempt 1 of 10" in warning, warning
    pids = [pid for s in (0, 1) for _, pid in launcher.starts(s)]
    launcher.stop(timeout=2.0)
    assert not any(process_alive(pid) for pid in pids)
    time.sleep(GRACE)  # no restart after stop
    assert len(launcher.starts(0)) + len(launcher.starts(1)) == 5
    assert launcher.processes == []


def test_stop_kills_a_worker_that_ignores_sigterm(tmp_path, launched):
    launcher = FakeLauncher(tmp_path, STUBBORN, RestartPolicy(**FAST))
    launched(launcher)
    launcher.start()
    wait_until(lambda: launcher.starts(), 10, "the start")
    [(_, pid)] = launcher.starts()
    began = time.monotonic()
    launcher.stop(timeout=0.5)
    assert 0.5 <= time.monotonic() - began < 5.0
    assert not process_alive(pid)
    assert len(launcher.starts()) == 1


def test_after_stop_restarting_an_exit_is_final(tmp_path, launched):
    launcher = FakeLauncher(tmp_path, LIVE, RestartPolicy(**FAST))
    launched(launcher)
    launcher.start()
    wait_until(lambda: launcher.starts(), 10, "the start")
    launcher.stop_restarting()
    pid = launcher.starts()[0][1]
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not process_alive(pid), 10, "the worker to end on SIGTERM")
    time.sleep(GRACE)  # dead, and not restarted
    assert len(launcher.starts()) == 1


def test_without_restarts_a_dead_worker_stays_dead(tmp_path, launched):
    launcher = FakeLauncher(tmp_path, FAIL, RestartPolicy(enabled=False, **FAST))
    launched(launcher)
    launcher.start()
    wait_until(lambda: launcher.starts(), 10, "the start")
    wait_until(lambda: launcher.processes[0].poll() is not None, 10, "the worker to fail")
    time.sleep(GRACE)  # dead, and not restarted
    assert len(launcher.starts()) == 1


def test_no_restart_option_reaches_thehead_config():
    parser = build_parser()
    assert head_config(parser.parse_args(["up"])).restart == RestartPolicy()
    for argv in (["up", "--no-restart"], ["run", "--no-restart", "--", "true"]):
        config = head_config(parser.parse_args(argv))
        assert config.restart.enabled is False, argv


def test_gc_settle_freezes_start_up_and_collects_young_objects_less_often():
    import gc

    from isthmus import gctune

    before = gc.get_threshold()
    try:
        gctune.settle()
        assert gc.get_freeze_count() > 1000  # what start-up made is out of sight
        assert gc.get_threshold() == (gctune.YOUNG, *gctune.OLDER)
        cycle = []
        cycle.append(cycle)  # a later cycle is still collected
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_cpu_lists_read_and_write_as_linux_writes_them():
    from isthmus.options import cpu_list, parse_cpus

    assert parse_cpus("0-3,8, 10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert cpu_list(parse_cpus("5")) == "5"
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_slices_get_disjoint_shares_of_the_cpus():
    from isthmus.launch import slice_cpus

    assert [slice_cpus([0, 1], 2, i) for i in range(2)] == [[0], [1]]
    assert [slice_cpus(list(range(7)), 3, i) for i in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [slice_cpus([4, 6], 3, i) for i in range(3)] == [[4], [6], [4]]  # fewer CPUs
    launcher = LocalLauncher("127.0.0.1:1", 2, 1, 2, pin_slices=True)
    shares = [launcher.cpu_options(i) for i in range(2)]
    assert all(flag == "--cpus" for flag, _ in shares)
    assert LocalLauncher("127.0.0.1:1", 2, 1, 2).cpu_options(0) == []


def test_pin_slices_needs_launched_workers(capsys):
    for extra in (["--devices", "4"], ["--no-launch"]):
        args = build_parser().parse_args(["up", "--pin-slices", *extra])
        with pytest.raises(SystemExit):
            head_config(args)
        assert "--pin-slices pins the workers" in capsys.readouterr().err


def test_pin_hosts_gives_each_worker_of_a_slice_its_own_share():
    """--pin-hosts: worker (slice s, host h) takes share s * hosts_per_slice + h, where
    --pin-slices gives all hosts of a slice the slice's share."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    launcher = LocalLauncher("127.0.0.1:1", 1, 2, 4, pin_hosts=True)
    options = [launcher.cpu_options(0, h) for h in range(2)]
    from isthmus.launch import slice_cpus
    from isthmus.options import cpu_list

    assert options == [["--cpus", cpu_list(slice_cpus(cpus, 2, h))] for h in range(2)]
    if len(cpus) >= 2:
        assert options[0] != options[1]
    by_slice = LocalLauncher("127.0.0.1:1", 1, 2, 4, pin_slices=True)
    assert by_slice.cpu_options(0, 0) == by_slice.cpu_options(0, 1)


def test_pin_hosts_needs_launched_workers(capsys):
    for extra in (["--devices", "4"], ["--no-launch"]):
        args = build_parser().parse_args(["up", "--pin-hosts", *extra])
        with pytest.raises(SystemExit):
            head_config(args)
        assert "--pin-hosts pins the workers" in capsys.readouterr().err
