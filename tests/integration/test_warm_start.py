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


# A server's first moments, as `isthmus up` has them: jax imported, one thread, no backend.
FORKED_HELPERS = """
import asyncio, os, sys, threading
import jax
from isthmus import warm_start
from isthmus.controller.vetting import ProgramVetter

async def main():
    vetter = ProgramVetter(trial=True)
    await vetter.spawn(fork=True)                       # the vetting process, forked
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    warm_start.prepare(env)                             # the workers' warm Python, forked
    assert vetter.forked == 1 and vetter.children == 1, (vetter.forked, vetter.children)
    text = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((4,), "float32")).as_text()
    vetted = await vetter.vet(text.encode())
    assert vetted.module and vetted.signature is not None
    await vetter.close()
    await vetter.spawn(fork=True)                       # threads now: a fresh interpreter
    assert vetter.forked == 1 and vetter.children == 2, (vetter.forked, vetter.children)
    assert await vetter.vet(text.encode()) == vetted    # remembered by the server
    await vetter.close()
    worker = [sys.executable, "-m", "isthmus.cli", "worker", "--controller", "127.0.0.1:1",
              "--slice", "0", "--devices", "2", "--exit-with-parent", "--connect-timeout",
              "0.5"]
    starter = warm_start.warm_start_for(worker, env, sys.argv[1])
    assert starter is not None and starter.log_path == os.path.join(sys.argv[1], "warm-start.log")
    log = os.path.join(sys.argv[1], "worker.log")
    assert warm_start.start_process(starter, worker, env, log).wait(60) == 3
    assert "127.0.0.1:1" in open(log).read()
    starter.close()
    print("forked:", open(starter.log_path).read().splitlines()[0])

asyncio.run(main())
"""


def test_a_server_forks_its_vetting_process_and_its_workers_warm_python(tmp_path):
    """`isthmus up` imports jax first and forks both from itself: each runs what a fresh
    interpreter would (a program vetted, a worker started that exits with its code), and a
    vetting process started once the server has threads is a fresh interpreter."""
    script = tmp_path / "server_start.py"
    script.write_text(FORKED_HELPERS)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                            text=True, timeout=180, env=_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "forked: isthmus warm start: forked from the server" in result.stdout, result.stdout


@pytest.mark.parametrize("args", [
    ["up", "--devices", "0"],  # refused: one line
    ["run", "--", "/no/such/program"],  # the default fleet starts, then the command fails
    ["run", "--devices", "1", "--", sys.executable, "-c",
     "import os; print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))"],  # what its command gets
], ids=["refused", "missing-command", "command-environment"])
def test_a_forked_isthmus_prints_what_a_fresh_one_prints(args):
    """`run_isthmus` (the suite's `isthmus` commands, forked from the warm servers' Python,
    which imported jax before the server's code) and a fresh `python -m isthmus.cli` give
    the same exit code and output, C++'s log lines included: the user set no log level."""
    from isthmus.testing import run_isthmus

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    fresh = subprocess.run([sys.executable, "-m", "isthmus.cli", *args], env=env,
                           capture_output=True, text=True, timeout=120)
    forked = run_isthmus(args, env=env, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode != 0 or fresh.stdout == "2\n", fresh  # `isthmus run`'s level


def test_a_forked_process_starts_with_its_warm_pythons_imports_frozen():
    """The warm Python freezes what it imported before it forks (`forking.serve`): a child's
    collections walk only what the child makes. Its script still runs as a fresh one would:
    a cycle it makes is collected."""
    from isthmus.testing import run_python

    result = run_python("""
import gc, sys
frozen = gc.get_freeze_count()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
print(frozen, gc.collect() >= 2, "jax" in sys.modules)
""", None, timeout=60)
    assert result.returncode == 0, result.stderr
    frozen, collected, jax_loaded = result.stdout.split()
    assert int(frozen) > 10_000 and collected == "True" and jax_loaded == "True", result.stdout
