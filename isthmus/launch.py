"""Starting worker processes on this machine (`isthmus up` with a local fleet), and starting
them again when they die.

The workers are the same program that Slurm or Kubernetes would start (`isthmus worker`),
with `--exit-with-parent` so that they never outlive the controller that launched them.
A restarted worker runs the same command: it takes the free host slot of its slice (the one
its predecessor left), so its devices keep their ids. Every process of a slot gets the slot's
crash-record path (`worker/crashes.py`, beside the logs): a worker that a program crashed is
followed by one that reports the program, which the controller then refuses, so a bad request
costs the slot one restart, not the whole restart budget.

CPU workers are forked from one Python that imported jax and the worker's code once
(`warm_start.py`): a fleet of four starts in about half the time. Anything else (an
accelerator's workers, a shared service's confined ones, a test's stand-in command) starts as
a fresh process.

A daemon thread (the watcher) polls the processes; the head's event loop never waits on it.
The restart decisions themselves are plain functions of `RestartPolicy`, testable without
processes; `LocalLauncher.command` is the seam that lets tests launch anything else.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from isthmus.logs import event
from isthmus.options import cpu_list
from isthmus.transport.auth import TOKEN_ENVIRONMENT
from isthmus.transport.tls import TlsConfig
from isthmus.warm_start import WarmStart, WorkerProcess, start_process, warm_start_for
from isthmus.worker.compile_cache import CacheConfig
from isthmus.worker.crashes import CRASH_RECORD_ENV
from isthmus.worker.platforms import EXIT_PLATFORM_UNAVAILABLE, Platform, visible_gpus
from isthmus.worker.sandbox import ENVIRONMENT as SANDBOX_ENVIRONMENT
from isthmus.worker.sandbox import Sandbox

logger = logging.getLogger(__name__)

# Inherited settings that would point a worker's jax somewhere other than its own devices.
_DROPPED_ENVIRONMENT = ("JAX_PLATFORMS", "JAX_BACKEND_TARGET", "XLA_FLAGS")

# Workers serve jax's CPU platform unless told otherwise (a frozen record, safe to share).
_DEFAULT_PLATFORM = Platform()


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When the launcher starts a dead worker again.

    Restart n (1-based) of a slot waits `min(initial_backoff * 2**(n-1), max_backoff)` s. A
    worker that lived `reset_after` s starts the count (and so the backoff) afresh: only
    restarts in quick succession count against `max_restarts`.
    """

    enabled: bool = True  # False: a worker that dies stays dead (`--no-restart`)
    max_restarts: int = 10  # restarts in a row per slot; past them the slot stays down
    initial_backoff: float = 0.5  # seconds before the first restart
    max_backoff: float = 8.0  # the backoff doubles up to this many seconds
    reset_after: float = 60.0  # seconds a worker must live to reset count and backoff
    poll_interval: float = 0.2  # seconds between two looks at the processes

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, not {self.max_restarts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError(
                f"backoff must satisfy 0 <= initial_backoff ({self.initial_backoff}) <= "
                f"max_backoff ({self.max_backoff})")
        if self.poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, not {self.poll_interval}")

    def attempt(self, restarts: int, lived: float) -> int:
        """The number of the restart that follows an exit, after `restarts` in a row and a
        worker that ran `lived` seconds."""
        return 1 if lived >= self.reset_after else restarts + 1

    def delay(self, attempt: int) -> float | None:
        """Seconds to wait before restart `attempt`; None: none (off, or past the limit)."""
        if not self.enabled or attempt > self.max_restarts:
            return None
        return min(self.initial_backoff * 2.0 ** (attempt - 1), self.max_backoff)


@dataclasses.dataclass(slots=True)
class WorkerSlot:
    """One worker the launcher keeps running, and its restart history.

    Invariant: `process` is None exactly while the slot waits for `restart_at` or, with
    `restart_at` also None, has been given up (or the launcher has stopped).
    """

    slice_index: int  # the slice its worker joins (`--slice`)
    host: int  # the launcher's count within the slice (the controller picks the host slot)
    log_path: pathlib.Path  # the worker's output, appended to by every restart
    crash_record: pathlib.Path  # its processes' crash records (`worker/crashes.py`)
    process: WorkerProcess | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    restarts: int = 0  # restarts in a row (see RestartPolicy.attempt)
    restart_at: float | None = None  # time.monotonic() of the next start, when one is due


def _last_line(path: pathlib.Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(see {path})"
    return lines[-1] if lines else f"(see {path})"


def describe_exit(code: int) -> str:
    """`exit code 3` or `signal SIGKILL`, from a Popen return code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def slice_cpus(available: list[int], slices: int, index: int) -> list[int]:
    """The CPUs of slice `index` when `slices` slices divide `available` (`--pin-slices`):
    consecutive equal shares, the first slices one CPU more when they do not come out even;
    with fewer CPUs than slices, slice i gets CPU i modulo their number."""
    cpus = sorted(available)
    if len(cpus) < slices:
        return [cpus[index % len(cpus)]]
    share, extra = divmod(len(cpus), slices)
    start = index * share + min(index, extra)
    return cpus[start:start + share + (index < extra)]


FLEET_CACHE_BYTES = 1 << 30  # of the fleet's own compilation cache (`keep_executables`)


class LocalLauncher:
    """Starts `isthmus worker` subprocesses, restarts those that die, and stops them all.

    Invariant: once `stop_restarting` (or `stop`) has returned, no process is started any
    more; every start happens under `_lock` after checking `_restarting`.
    """

    def __init__(self, controller: str, slices: int, hosts_per_slice: int,
                 devices_per_host: int, log_dir: str | None = None,
                 restart: RestartPolicy = RestartPolicy(),
                 platform: Platform = _DEFAULT_PLATFORM, token: str = "",
                 tls: TlsConfig | None = None, pin_slices: bool = False,
                 pin_hosts: bool = False, join_tokens: Callable[[], str] | None = None,
                 sandbox: Sandbox | None = None, keep_executables: bool = False) -> None:
        self.controller = controller
        # Each slice's workers (`pin_hosts`: each worker) run on a share of this machine's
        # CPUs of their own, as slices (hosts) on separate hardware would (`slice_cpus`);
        # None: all run anywhere.
        self.cpus = sorted(os.sched_getaffinity(0)) if pin_slices or pin_hosts else None
        self.pin_hosts = pin_hosts
        self.token = token  # the fleet's, handed to each worker in its environment...
        # ... unless each start gets a single-use join token of its own, made by this
        # (`transport/auth.py`; a shared service's workers), and the fleet's data key.
        self.join_tokens = join_tokens
        self.sandbox = sandbox  # each worker confines itself so (`worker/sandbox.py`), or None
        self.tls = tls  # the controller's certificate, which local workers share
        self.slices = slices
        self.hosts_per_slice = hosts_per_slice
        self.devices_per_host = devices_per_host
        self.restart = restart
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="isthmus-workers-"))
        self._own_cache: pathlib.Path | None = None
        if keep_executables and platform.compile_cache is None:
            # A compilation cache of the fleet's own: a worker started again in a slot loads
            # what the worker before it compiled, instead of compiling it again.
            self._own_cache = self.log_dir / "executables"
            platform = dataclasses.replace(platform, compile_cache=CacheConfig(
                str(self._own_cache), max_bytes=FLEET_CACHE_BYTES))
        self.platform = platform
        self.slots: list[WorkerSlot] = []
        self.restarted = 0  # workers started again after an exit (for the metrics)
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._restarting = False
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._warm: WarmStart | None = None  # forks the CPU workers (`warm_start.py`)

    def command(self, slice_index: int, host: int = 0) -> list[str]:
        """The command line of the worker of `slice_index`, `host` (tests override it)."""
        return [sys.executable, "-m", "isthmus.cli", "worker", "--controller", self.controller,
                "--slice", str(slice_index), "--devices", str(self.devices_per_host),
                "--exit-with-parent", *self.platform_options(slice_index, host),
                *self.cpu_options(slice_index, host)]

    def cpu_options(self, slice_index: int, host: int = 0) -> list[str]:
        """`--cpus LIST` for a worker when slices (or hosts) are pinned."""
        if self.cpus is None:
            return []
        if self.pin_hosts:
            share = slice_cpus(self.cpus, self.slices * self.hosts_per_slice,
                               slice_index * self.hosts_per_slice + host)
        else:
            share = slice_cpus(self.cpus, self.slices, slice_index)
        return ["--cpus", cpu_list(share)]

    def platform_options(self, slice_index: int, host: int) -> list[str]:
        """The worker's platform options, and the compilation cache it shares with us."""
        cache = self.platform.compile_cache
        shared = [] if cache is None else [
            "--compile-cache", cache.location, "--compile-cache-namespace", cache.namespace,
            "--compile-cache-size", str(cache.max_bytes)]
        tls = [] if self.tls is None else [
            "--tls-cert", self.tls.cert, "--tls-key", self.tls.key, "--tls-ca", self.tls.ca]
        return self._device_options(slice_index, host) + shared + tls

    def _device_options(self, slice_index: int, host: int) -> list[str]:
        """`--platform cuda --gpus ...` for a CUDA worker: worker w of the fleet takes GPUs
        w*D .. w*D+D-1 (D devices per host), wrapping round when there are fewer GPUs than
        devices, so that workers share GPUs (and divide the memory share) in tests."""
        if self.platform.simulate_flops:
            return ["--simulate-flops", f"{self.platform.simulate_flops:g}"]
        if self.platform.name == "cpu":
            return []
        if self.platform.name == "tpu":  # the machine's chips, all of them (libtpu's unit)
            return ["--platform", "tpu"]
        gpus = self.platform.gpus or visible_gpus() or (0,)
        per_host = self.devices_per_host
        if per_host > len(gpus):
            raise ValueError(f"{per_host} GPUs per host asked for, {len(gpus)} available "
                             f"({','.join(map(str, gpus))})")
        workers = self.slices * self.hosts_per_slice
        sharing = -(-workers * per_host // len(gpus))  # workers on the busiest GPU
        first = (slice_index * self.hosts_per_slice + host) * per_host
        mine = [gpus[(first + k) % len(gpus)] for k in range(per_host)]
        return ["--platform", self.platform.name, "--gpus", ",".join(map(str, mine)),
                "--gpu-memory-fraction", f"{self.platform.memory_fraction / sharing:.4g}"]

    @property
    def processes(self) -> list[WorkerProcess]:
        """The worker processes started last in each slot (running or not yet noticed dead)."""
        with self._lock:
            return [s.process for s in self.slots if s.process is not None]

    def start(self) -> None:
        if self.slots:
            raise RuntimeError("this launcher has started its workers already; make a new one")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENVIRONMENT}
        self._env[TOKEN_ENVIRONMENT] = self.token
        if self.sandbox is not None:
            cache = self.platform.compile_cache
            local_cache = [cache.location] if cache is not None and "://" not in cache.location \
                else []
            self._env[SANDBOX_ENVIRONMENT] = dataclasses.replace(
                self.sandbox, writable=(*self.sandbox.writable, str(self.log_dir),
                                        *local_cache)).encode()
        self._warm = warm_start_for(self.command(0), self._env, str(self.log_dir))
        with self._lock:
            for slice_index in range(self.slices):
                for host in range(self.hosts_per_slice):
                    name = f"worker-s{slice_index}-h{host}"
                    slot = WorkerSlot(slice_index, host, self.log_dir / f"{name}.log",
                                      self.log_dir / f"{name}.crash")
                    self.slots.append(slot)
                    self._spawn(slot)
            self._restarting = self.restart.enabled
        logger.info("started %d workers; logs in %s", len(self.slots), self.log_dir)
        if self.restart.enabled:
            self._watcher = threading.Thread(target=self._watch, name="isthmus-launcher",
                                             daemon=True)
            self._watcher.start()

    def stop_restarting(self) -> None:
        """From now on a worker that exits stays down (the head calls this before it tells
        the workers to shut down, so that their exits are not taken for failures)."""
        with self._lock:
            self._restarting = False

    def renew(self, slice_index: int, timeout: float = 10.0) -> list[int]:
        """Replaces the workers of a slice with fresh processes (a shared service's slice
        after a lease whose tenant ran its own code there): SIGTERM, SIGKILL after
        `timeout` s, then a new start at once, not counted as a restart. Returns the old
        pids. Blocks: call it from a thread."""
        with self._lock:
            if not self._restarting and self.restart.enabled:
                return []  # stopping
            slots = [s for s in self.slots if s.slice_index == slice_index]
            old = [s.process for s in slots if s.process is not None]
            for slot in slots:
                slot.process, slot.restart_at = None, None
        _end(old, timeout)
        with self._lock:
            if self._restarting or not self.restart.enabled:
                for slot in slots:
                    if slot.process is None:
                        slot.restarts = 0
                        self._spawn(slot)
        return [p.pid for p in old]

    def stop(self, timeout: float = 10.0) -> None:
        """Stops restarting, then the workers: SIGTERM, and SIGKILL for those still running
        after `timeout` s. Returns once none is left."""
        self.stop_restarting()
        _end(self.processes, timeout)
        # The watcher ends only now: a worker started by it dies with it (PR_SET_PDEATHSIG
        # follows the thread that forked the worker), and these are all dead already.
        self._done.set()
        if self._watcher is not None:
            self._watcher.join(timeout)
            self._watcher = None
        with self._lock:
            for slot in self.slots:
                slot.process = None
                slot.restart_at = None
        if self._warm is not None:
            self._warm.close(timeout)
            self._warm = None
        if self._own_cache is not None:  # the fleet's executables go with it (logs stay)
            shutil.rmtree(self._own_cache, ignore_errors=True)

    # ---- the watcher ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._done.wait(self.restart.poll_interval):
            with self._lock:
                if not self._restarting:
                    continue
                for slot in self.slots:
                    try:
                        self._tend(slot, time.monotonic())
                    except Exception:
                        logger.exception("watching the worker of slice %s host %s failed",
                                         slot.slice_index, slot.host)

    def _tend(self, slot: WorkerSlot, now: float) -> None:
        """Notices an exit and schedules a restart, or starts a restart that is due."""
        if slot.process is not None:
            code = slot.process.poll()
            if code is not None:
                pid, slot.process = slot.process.pid, None
                if code == EXIT_PLATFORM_UNAVAILABLE:  # its host cannot serve: no restart
                    logger.error("worker %s cannot serve %s devices here (slice %s, host %s), "
                                 "and is not restarted: %s", pid, self.platform.name,
                                 slot.slice_index, slot.host, _last_line(slot.log_path))
                    return
                self._exited(slot, now, f"worker {pid} ended with {describe_exit(code)} "
                                        f"after {now - slot.started_at:.1f} s")
        elif slot.restart_at is not None and now >= slot.restart_at:
            slot.restart_at = None
            self._spawn(slot)

    def _exited(self, slot: WorkerSlot, now: float, how: str) -> None:
        attempt = self.restart.attempt(slot.restarts, now - slot.started_at)
        delay = self.restart.delay(attempt)
        if delay is None:
            logger.error(
                "%s (slice %s, host %s) and was restarted %d times in a row; the slot stays "
                "down. Read %s, then start a worker by hand: isthmus worker --controller %s "
                "--slice %s --devices %s", how, slot.slice_index, slot.host, slot.restarts,
                slot.log_path, self.controller, slot.slice_index, self.devices_per_host)
            return
        slot.restarts = attempt
        slot.restart_at = now + delay
        logger.warning("%s (slice %s, host %s); restarting it in %.1f s (attempt %d of %d); "
                       "its log: %s", how, slot.slice_index, slot.host, delay, attempt,
                       self.restart.max_restarts, slot.log_path, extra=event(
                           "worker_restarting", slice=slot.slice_index, host=slot.host,
                           attempt=attempt))

    def _spawn(self, slot: WorkerSlot) -> None:
        """Starts the slot's worker, appending to its log. Call with `_lock` held."""
        if slot.restarts:
            with open(slot.log_path, "ab") as log:
                log.write(f"--- isthmus launcher: restart {slot.restarts} of "
                          f"{self.restart.max_restarts} ---\n".encode())
        slot.started_at = time.monotonic()
        try:
            slot.process = start_process(
                self._warm, self.command(slot.slice_index, slot.host),
                {**self._env, CRASH_RECORD_ENV: str(slot.crash_record),
                 **({} if self.join_tokens is None else
                    {TOKEN_ENVIRONMENT: self.join_tokens()})}, str(slot.log_path))
        except OSError as e:
            if not self._restarting:  # the first start: the caller hears of it
                raise
            self._exited(slot, slot.started_at, f"starting a worker failed: {e}")
            return
        if slot.restarts:
            self.restarted += 1
            logger.info("restarted the worker of slice %s host %s as pid %s",
                        slot.slice_index, slot.host, slot.process.pid, extra=event(
                            "worker_restarted", slice=slot.slice_index, host=slot.host,
                            pid=slot.process.pid))


def _end(processes: list[WorkerProcess], timeout: float) -> None:
    """SIGTERM to each process still running, SIGKILL to those still running `timeout` s
    later; returns once all have exited."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("worker %s ignored SIGTERM for %g s; killing it", process.pid,
                           timeout)
            process.kill()
            process.wait(timeout)
