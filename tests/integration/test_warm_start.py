"""Workers forked from the warm Python (`isthmus/warm_start.py`): what the launcher asks of a
process (pid, exit code, signals, wait with a timeout), the log, and the ends of the warm
Python itself. The fleets of the other integration tests start their workers this way; these
check the process rules with workers that have no controller to join."""

import json
import os
import signal
import subprocess
import sys

import pytest

from isthmus.testing import process_alive, wait_until
from isthmus.warm_start import ENVIRONMENT, WarmStart, forkable, start_process, warm_start_for
from isthmus.worker.sandbox import ENVIRONMENT as SANDBOX


def _worker(timeout: float) -> list[str]:
    """A worker whose controller never answers: it waits `timeout` s, then exits with 3."""
    return [sys.executable, "-m", "isthmus.cli", "worker", "--controller", "127.0.0.1:1",
            "--slice", "0", "--devices", "2", "--exit-with-parent",
            "--connect-timeout", str(timeout)]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}


def test_which_commands_are_forked():
    env = _env()
    assert forkable(_worker(1), env)
    assert not forkable([sys.executable, "-m", "isthmus.cli", "up"], env)
    assert not forkable(["/usr/bin/python3", *_worker(1)[1:]], env)  # another interpreter
    assert not forkable([*_worker(1), "--platform", "cuda"], env)  # reads its environment
    assert not forkable(_worker(1), {**env, SANDBOX: "{}"})  # confines itself first
    assert not forkable(_worker(1), {**env, ENVIRONMENT: "0"})
    assert warm_start_for([sys.executable, "-c", "pass"], env, "/nonexistent") is None


@pytest.fixture(scope="module")
def starter(tmp_path_factory):
    warm = WarmStart(_env(), str(tmp_path_factory.mktemp("warm") / "warm-start.log"))
    yield warm
    warm.close()


def test_a_forked_worker_is_a_process_with_its_exit_code_and_log(starter, tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("before\n")
    # The request's environment is the worker's: here, its log's format.
    process = start_process(starter, _worker(0.5), {**_env(), "ISTHMUS_LOG_FORMAT": "json"},
                            str(log))
    assert process.pid != os.getpid() and process_alive(process.pid)
    assert process.poll() is None
    assert process.wait(60) == 3  # no controller within --connect-timeout
    assert process.poll() == 3
    lines = log.read_text().splitlines()
    assert lines[0] == "before" and "127.0.0.1:1" in "".join(lines), lines  # appended
    assert any(line.startswith("{") and json.loads(line) for line in lines[1:]), lines


def test_signals_and_a_wait_that_times_out(starter, tmp_path):
    process = start_process(starter, _worker(60), _env(), str(tmp_path / "w.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.2)
    process.send_signal(signal.SIGTERM)  # the worker takes it as a stop
    assert process.wait(30) == 0
    process.send_signal(signal.SIGTERM)  # ended: no signal to a pid that may be reused
    other = start_process(starter, _worker(60), _env(), str(tmp_path / "w2.log"))
    other.kill()
    assert other.wait(30) == -signal.SIGKILL


def test_the_workers_die_with_the_warm_python(tmp_path):
    starter = WarmStart(_env(), str(tmp_path / "warm-start.log"))
    process = start_process(starter, _worker(60), _env(), str(tmp_path / "w.log"))
    wait_until(lambda: (tmp_path / "w.log").exists(), 30, "the worker's log")
    starter.close()
    assert process.wait(30) == -signal.SIGKILL
    wait_until(lambda: not process_alive(process.pid), 30, "the worker's end")
    assert not starter.alive()
    # A start after the warm Python has gone is a fresh process.
    fresh = start_process(starter, _worker(0.5), _env(), str(tmp_path / "fresh.log"))
    assert isinstance(fresh, subprocess.Popen)
    assert fresh.wait(60) == 3
