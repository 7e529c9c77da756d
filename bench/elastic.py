"""Elastic recovery, measured: python -m bench.elastic [--chaos SECONDS].

Runs `examples/elastic_train.py` (pathwaysutils' elastic Manager, orbax's in-memory
Snapshotter, a 3-layer MLP data parallel over the slices that are up) through a local fleet
of 2 slices x 1 host x 4 devices, kills slice 1's worker in the middle of the run and later
starts a replacement, and breaks both recoveries down from the server's log, the example's
JSON log and the moments this driver acted:

    loss:     kill -> controller notices -> client sees DATA_LOSS -> Manager's cleanup and
              health check -> group re-formed -> snapshot restored -> step compiled ->
              first step on the remaining slice
    scale-up: replacement started -> joined -> group re-formed -> Manager's monitor sees it
              -> step boundary -> restore, compile, first step on both slices

`--chaos SECONDS` instead kills a worker every ~10 s for that long while the launcher
restarts them, then compares every step's loss with the same history replayed in local jax
(`bench/elastic_replay.py`: each step on the slices it ran on) and with an undisturbed run,
and reports the memory of the controller and the workers at the start and the end.

No figure here is a test assertion; `tests/integration/test_chaos.py` (slow) asserts what must
hold (no crash, losses equal to local jax's) through `chaos()`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.elastic_replay import replay, schedule
from isthmus.serve import child_environment
from isthmus.testing import LocalServer

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic_train.py"
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class Run:
    """The example as a client process, with its JSON log followed as it is written."""

    def __init__(self, server: LocalServer, args: list[str], folder: str) -> None:
        self.log_path = os.path.join(folder, f"run-{time.monotonic_ns()}.jsonl")
        env = child_environment(server.address)
        env.pop("XLA_FLAGS", None)
        self.process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--log-json", self.log_path, *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        try:
            with open(self.log_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        return [r for r in rows if kind is None or r["kind"] == kind]

    def wait_for(self, what: str, found: Callable[[list[dict[str, Any]]], Any],
                 timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = found(self.records())
            if value:
                return value
            if self.process.poll() is not None:
                raise RuntimeError(f"the client ended while waiting for {what}:\n"
                                   f"{self.process.communicate()[0][-4000:]}")
            time.sleep(0.02)
        self.process.kill()
        raise TimeoutError(f"no {what} within {timeout} s; the client printed:\n"
                           f"{self.process.communicate()[0][-3000:]}")

    def finish(self, timeout: float) -> str:
        out, _ = self.process.communicate(timeout=timeout)
        with open(self.log_path.replace(".jsonl", ".out"), "w") as f:
            f.write(out)  # kept beside the JSON log
        if self.process.returncode:
            raise RuntimeError(f"the client failed ({self.process.returncode}):\n{out[-4000:]}")
        return out


def _steps(rows: list[dict[str, Any]], slices: list[int], after: float) -> list[dict]:
    return [r for r in rows if r["kind"] == "step" and r["slices"] == slices
            and r["time"] > after]



def log_times(text: str, pattern: str, after: float) -> list[float]:
    """Times (epoch seconds) of the server-log lines matching `pattern`, after `after`."""
    found = []
    for line in text.splitlines():
        stamp = _STAMP.match(line)
        if stamp and re.search(pattern, line):
            when = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
            if when.timestamp() > after:
                found.append(when.timestamp())
    return found


def _formation(log: str, after: float) -> tuple[float, float]:
    began = log_times(log, r"forming collective group", after)[0]
    return began, log_times(log, r"collective group \d+ formed", began - 0.001)[0]


def _ready(rows: list[dict[str, Any]], attempt: int) -> dict[str, Any]:
    """An attempt's `ready` record (restored and compiled) with its first step's."""
    ready = next(r for r in rows if r["kind"] == "ready" and r["attempt"] == attempt)
    first = next(r for r in rows if r["kind"] == "step" and r["attempt"] == attempt)
    return {**ready, "first_step_s": first["step_s"], "first_step_done": first["time"]}


def _attempt(ready: dict[str, Any], normal_step: float) -> dict[str, float]:
    """An attempt's own phases, from its `ready` record: the Manager's wait, tracing,
    restoring, compiling and the first step."""
    seconds = ready.get("restore_s", 0.0)
    return {
        "Manager cleanup + health check": ready["wait_s"],
        "model's shapes traced (workload)": ready["abstract_s"],
        "snapshot restored": seconds,
        "  restore rate (GB/s, per replica)": ready.get("restored_bytes", 0) / 1e9
        / max(seconds, 1e-9),
        "step traced and lowered (jax)": ready["lower_s"],
        "step compiled (server)": ready["compile_s"],
        "first step": ready["first_step_s"],
        "  of which beyond a normal step": ready["first_step_s"] - normal_step}


def _loss(rows: list[dict[str, Any]], log: str, killed: float, first: dict[str, Any],
          normal_step: float) -> dict[str, float]:
    errors = [r for r in rows if r["kind"] == "error" and r["time"] > killed]
    ready = _ready(rows, first["attempt"])
    formed = _formation(log, killed)
    return {
        "controller notices the loss": log_times(log, r"was lost", killed)[0] - killed,
        "client sees DATA_LOSS": (errors[0]["time"] - killed) if errors else float("nan"),
        "group re-formed (in parallel)": formed[1] - formed[0],
        **_attempt(ready, normal_step),
        "total: kill -> first step done": ready["first_step_done"] - killed}


def _normal_step(rows: list[dict[str, Any]], slices: list[int]) -> float:
    """The median step time on `slices`, first steps of attempts left out."""
    import statistics

    firsts = {_ready(rows, r["attempt"])["first_step_done"] for r in rows
              if r["kind"] == "ready"}
    times = [r["step_s"] for r in rows if r["kind"] == "step" and r["slices"] == slices
             and r["time"] not in firsts]
    return statistics.median(times) if times else float("nan")


def recovery(devices_per_host: int = 4, kill_at_step: int = 15, steps: int = 100000,
             poll_interval: float = 0.5, model: str = "mlp",
             step_delay: float = 0.02) -> dict[str, dict[str, float]]:
    """A loss, the scale-up when the slice is back, and a second loss of the same slice
    (its mesh seen before), broken down (seconds)."""
    # The client is stopped once the second loss's first step is logged.
    args = ["--steps", str(steps), "--snapshot-every", "5", "--poll-interval",
            str(poll_interval), "--print-every", "1000", "--step-delay", str(step_delay),
            "--model", model, "--batch-size", "16" if model != "mlp" else "64"]
    with tempfile.TemporaryDirectory() as folder, LocalServer(
            devices=None, fleet=(2, 1, devices_per_host),
            args=["--no-restart", "--log-level", "INFO"]) as server:
        run = Run(server, args, folder)
        replacement = None
        try:
            victim = server.worker_pids(1)[0]  # not at the kill: a status call takes a while
            run.wait_for(f"step {kill_at_step}", lambda rows: _steps(rows, [0, 1], 0)[
                kill_at_step - 1:], 300)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            first = run.wait_for("a step on slice 0 alone",
                                 lambda rows: _steps(rows, [0], killed), 120)[0]
            run.wait_for("5 more steps", lambda rows: _steps(rows, [0], killed)[4:], 120)
            started = time.time()
            # Started as the fleet's launcher would: with the fleet's compilation cache.
            logs = re.search(r"logs in (\S+)", server.log())
            cache = ["--compile-cache", f"{logs.group(1)}/executables"] if logs and \
                os.path.isdir(f"{logs.group(1)}/executables") else []
            replacement = subprocess.Popen(
                [sys.executable, "-m", "isthmus.cli", "worker", "--controller",
                 server.address.removeprefix("grpc://"), "--slice", "1", "--devices",
                 str(devices_per_host), *cache], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            back = run.wait_for("a step on both slices again",
                                lambda rows: _steps(rows, [0, 1], started), 180)[0]
            run.wait_for("5 steps on both", lambda rows: _steps(rows, [0, 1], started)[4:],
                         120)
            worker = server.worker_pids(1)[0]
            replacement.kill()  # its supervisor first: the worker is not to come back
            replacement.wait()
            again = time.time()
            os.kill(worker, signal.SIGKILL)
            second = run.wait_for("a step on slice 0 alone again",
                                  lambda rows: _steps(rows, [0], again), 120)[0]
            run.wait_for("2 more steps", lambda rows: _steps(rows, [0], again)[1:], 120)
            rows, log = run.records(), server.log()
            with open(ROOT / "bench" / "out" / f"elastic-{model}.server.log", "w") as f:
                f.write(log)  # kept for a look at the phases
        finally:
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()
            if replacement is not None and replacement.poll() is None:
                replacement.kill()
                replacement.wait()
    one, both = _normal_step(rows, [0]), _normal_step(rows, [0, 1])
    attempts = {r["attempt"]: r for r in rows if r["kind"] == "attempt"}
    after_join = _ready(rows, back["attempt"])
    joined = log_times(log, r"joined as slice 1", started)[0]
    formed_join = _formation(log, joined)
    signalled = attempts[back["attempt"] - 1]["ended"]
    return {
        "loss": _loss(rows, log, killed, first, one),
        "scale_up": {
            "worker started -> joined": joined - started,
            "group re-formed": formed_join[1] - formed_join[0],
            "monitor sees it, step boundary": signalled - formed_join[1],
            **_attempt(after_join, both),
            "total: start -> step on all slices": after_join["first_step_done"] - started},
        "second_loss": _loss(rows, log, again, second, one),
        "steps": {"normal step, slice 0": one, "normal step, both slices": both},
    }


def rss_mib(pid: int) -> float:
    """A process's resident set (VmRSS) in MiB, NaN when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _memory(server: LocalServer) -> dict[str, float]:
    status = server.status()
    sizes = {"controller": rss_mib(server.process.pid)}  # type: ignore[union-attr]
    for slot, entry in sorted(status["fleet"].items()):
        sizes[f"worker {slot}"] = rss_mib(entry["pid"])
    return sizes


# One device per worker: with several, XLA:CPU's gloo sometimes aborts a survivor whose peer
# dies mid-collective, in plain multi-process JAX too (tools/gloo_peer_loss.py).
CHAOS_DEVICES_PER_HOST = 1


def chaos(seconds: float = 60.0, every: float = 10.0,
          devices_per_host: int = CHAOS_DEVICES_PER_HOST,
          step_delay: float = 0.05) -> dict[str, Any]:
    """Kills a worker every `every` seconds for `seconds` while the launcher restarts it;
    returns the run's losses beside those of an undisturbed run, and memory figures."""
    # Enough steps to outlast the kills (a step takes step_delay plus a few ms).
    steps = int(seconds / step_delay) + 200
    args = ["--steps", str(steps), "--snapshot-every", "5", "--poll-interval", "0.5",
            "--print-every", "1000", "--step-delay", str(step_delay)]
    kills: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        with LocalServer(devices=None, fleet=(2, 1, devices_per_host)) as server:
            run = Run(server, args, folder)
            run.wait_for("the first 20 steps", lambda rows: _steps(rows, [0, 1], 0)[19:], 180)
            memory_before = _memory(server)
            began = time.monotonic()
            victim = 1
            while time.monotonic() - began < seconds and run.process.poll() is None:
                time.sleep(every)
                status = server.status()
                if str(victim) in status["slices_down"]:
                    continue  # still restarting from the last kill
                server.kill_worker(victim)
                kills.append({"slice": victim, "at_s": time.monotonic() - began})
                victim = 1 - victim
            try:
                output = run.finish(timeout=600)
            finally:
                with open(run.log_path.replace(".jsonl", ".server.log"), "w") as f:
                    f.write(server.log())
            time.sleep(1.0)  # the last heartbeats
            memory_after = _memory(server)
            disturbed = run.records()
        with LocalServer(devices=None, fleet=(2, 1, devices_per_host)) as server:
            reference = Run(server, [*args[:-2], "--step-delay", "0"], folder)
            reference.finish(timeout=600)
            undisturbed = reference.records()
    losses = {r["step"]: r["loss"] for r in disturbed if r["kind"] == "step"}
    expected = {r["step"]: r["loss"] for r in undisturbed if r["kind"] == "step"}
    relative = sorted(abs(losses[s] - expected[s]) / max(abs(expected[s]), 1e-12)
                      for s in expected if s in losses)
    # The first attempt runs the undisturbed run's programs on its devices, step for step.
    first = [abs(r["loss"] - expected[r["step"]]) / max(abs(expected[r["step"]]), 1e-12)
             for r in disturbed if r["kind"] == "step" and r.get("attempt") == 1
             and r["step"] in expected]
    tail = sorted(s for s in expected if s in losses)[-100:]
    replayed = replay(schedule(disturbed), devices_per_slice=devices_per_host, slices=2)
    off = sorted((abs(losses[s] - replayed[s]) / max(abs(replayed[s]), 1e-12), s)
                 for s in losses if s in replayed)
    return {"steps": steps, "kills": kills, "steps_logged": len(losses),
            "steps_run": sum(1 for r in disturbed if r["kind"] == "step"),
            "attempts": sum(1 for r in disturbed if r["kind"] == "attempt"),
            "worst_relative_loss_difference": relative[-1],
            "median_relative_loss_difference": relative[len(relative) // 2],
            "first_attempt_worst_relative_difference": max(first, default=float("nan")),
            "last_100_mean_loss": sum(losses[s] for s in tail) / len(tail),
            "expected_last_100_mean_loss": sum(expected[s] for s in tail) / len(tail),
            "replay_worst_relative_difference": off[-1][0] if off else float("nan"),
            "replay_worst_step": off[-1][1] if off else None,
            "losses": losses, "expected": expected, "replayed": replayed,
            "memory_mib_before": memory_before, "memory_mib_after": memory_after,
            "tail": output[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chaos", type=float, metavar="SECONDS",
                        help="kill a worker every ~10 s for this long instead")
    parser.add_argument("--rounds", type=int, default=3, help="recoveries to take medians of")
    parser.add_argument("--model", default="mlp",
                        help="the example's --model: mlp, or lm-base (a Flax NNX transformer; "
                             "needs flax, re-run under .venv-new when missing)")
    parser.add_argument("--devices-per-host", type=int, default=None,
                        help="devices per worker (default: 1 for --chaos, 4 for recovery); "
                             "see the gloo known issue in docs/elastic.md")
    args = parser.parse_args()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    if args.model != "mlp" and importlib.util.find_spec("flax") is None:
        print(f"--model {args.model} needs flax: run this under the workloads environment "
              f"(.venv-new/bin/python -m bench.elastic ..., that scripts/test makes)")
        return 2
    if args.chaos:
        result = chaos(args.chaos, devices_per_host=args.devices_per_host or
                       CHAOS_DEVICES_PER_HOST)
        print(f"{len(result['kills'])} kills in {args.chaos:g} s; {result['steps_run']} steps "
              f"run for {result['steps']} in {result['attempts']} attempts; worst relative "
              f"loss difference from an undisturbed run: "
              f"{result['worst_relative_loss_difference']:.2e} (median "
              f"{result['median_relative_loss_difference']:.2e}; first attempt "
              f"{result['first_attempt_worst_relative_difference']:.2e}); mean loss of the "
              f"last 100 steps {result['last_100_mean_loss']:.4f} against "
              f"{result['expected_last_100_mean_loss']:.4f}")
        print(f"the same history replayed in local jax: worst relative difference "
              f"{result['replay_worst_relative_difference']:.2e}")
        print(f"{'memory (MiB RSS)':24}{'start':>10}{'end':>10}")
        for name, before in result["memory_mib_before"].items():
            after = result["memory_mib_after"].get(name, float("nan"))
            print(f"{name:24}{before:10.0f}{after:10.0f}")
        (out / "chaos.json").write_text(json.dumps(result, indent=2, default=str))
        return 0
    rounds = [recovery(devices_per_host=args.devices_per_host or 4, model=args.model)
              for _ in range(args.rounds)]
    import statistics

    print(f"elastic recovery of {args.model} on a 2 x 1 x {args.devices_per_host or 4} fleet "
          f"(examples/elastic_train.py), seconds, "
          f"median of {len(rounds)} (min - max):")
    for phase in rounds[0]:
        print(f"\n{phase}:")
        for key in rounds[0][phase]:
            values = [r[phase][key] for r in rounds]
            print(f"  {key:38}{statistics.median(values):8.2f}   "
                  f"({min(values):.2f} - {max(values):.2f})")
    (out / f"elastic-{args.model}.json").write_text(json.dumps(rounds, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
