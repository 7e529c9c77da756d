"""Profiles of the fleet: pathwaysutils' `profileRequest`, jax's profiler on every host.

After `pathwaysutils.initialize()`, `jax.profiler.start_trace(log_dir)` compiles a plugin
program naming the trace location and how many hosts to profile, and calls it twice: the
first call starts the profile, the second stops it. Here the start asks the first
`max_hosts` live hosts of the session (in fleet order) to start jax's profiler, then starts
the controller's own; the stop has each of them write its XSpace into the run directory
`LOCATION/plugins/profile/RUN/`, one `HOST.xplane.pb` per host, which xprof opens as one
run with a host per worker. Starts and stops go in the session's dispatch order, so the
programs the client ran in between are in the trace.

One profile runs on the fleet at a time (jax's profiler is one per process); another
client's start meanwhile fails with FAILED_PRECONDITION. A profile stops by itself after
`max_duration`, and when the session that started it ends.

On a shared service (the session has `TenantFiles`) a profile is its lease's: it covers the
lease's workers only (they serve no other lease while it holds them) and never the
controller, whose work is every tenant's; it is written inside the tenant's storage root
(`storage.py`); it runs at most the service's `max_profile_seconds` (a request without a
duration gets that); and one runs per lease at a time, so tenants never wait on each other's.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, Protocol

import numpy as np

from isthmus import dtypes, errors
from isthmus import profiling as profiler
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array
from isthmus.controller.controller import Controller
from isthmus.controller.executables import Executable, plan_of
from isthmus.controller.session_arrays import HostData, HostShard
from isthmus.controller.session_checkpoints import plugin_info
from isthmus.controller.session_core import Keeper, SessionCore, as_error
from isthmus.ids import ExecutableId, WorkerId
from isthmus.transport import commands as c
from isthmus.transport.records import Aval, TraceOptions

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ProfilePlan:
    """A `profileRequest`: where the profile goes, and of what."""

    location: str  # the log directory (local path or fsspec URL); runs go in plugins/profile
    max_hosts: int  # how many hosts (workers) to profile, the first ones in fleet order
    controller: bool  # the controller's own trace too (`includeResourceManagers`)
    run: str | None  # the run directory's name (`traceSessionName`); None: the start time
    output: bool  # each call returns one string array (`xprofTraceOptions` was given)
    options: TraceOptions
    max_duration: float | None  # seconds after which the profile stops by itself
    private: ClassVar[bool] = True  # the session's own executable (`Controller.executable`)
    on_hosts: ClassVar[bool] = False  # nothing to load on the workers


class FleetTrace:
    """One profile of the fleet, from its start to its files."""

    def __init__(self, plan: ProfilePlan, caller: ExecutableId,
                 hosts: list[tuple[WorkerId, str]], directory: str, scope: str = "") -> None:
        self.id = secrets.token_hex(8)  # names it to the hosts' profilers
        self.plan = plan
        self.caller = caller  # the executable whose next call stops it
        self.hosts = hosts  # (worker, its label in file names)
        self.scope = scope  # its key in `Controller.profiles`: "" the fleet, or a lease's id
        self.directory = directory  # the run directory
        self.own = False  # this process's profiler records it for the controller
        loop = asyncio.get_running_loop()
        self.started: asyncio.Future[None] = loop.create_future()
        self.stopped: asyncio.Future[list[str]] | None = None  # once stopping: the files
        self.timer: asyncio.TimerHandle | None = None
        # Its start and stop are not tasks of the session: they finish after it ends.
        self.tasks: set[asyncio.Future[None]] = set()

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class ProfileArrays(Protocol):
    """What profiles need of the session's arrays (`SessionArrays`)."""

    def make_array(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                   host: HostShard) -> Array: ...


class SessionProfiles:
    """Starting and stopping profiles of the fleet (a part of `Session`, which makes the
    run directory's name an array through its arrays, `ProfileArrays`, and holds a profile
    plan's executable in its programs, a `Keeper`)."""

    def __init__(self, core: SessionCore, arrays: ProfileArrays, programs: Keeper) -> None:
        self.core = core
        self.controller = core.controller
        self.fleet = core.fleet
        self.dispatcher = core.dispatcher
        self.arrays = arrays
        self.programs = programs
        # The profiles this session started and has not stopped, by the executable that
        # started them (its next call stops them).
        self._profiles: dict[ExecutableId, FleetTrace] = {}

    def compile(self, plan: ProfilePlan) -> Executable:
        files = self.core.files
        if files is not None:  # a lease's profile: its workers, into its tenant's root
            cap = files.max_profile_seconds
            plan = dataclasses.replace(
                plan, location=files.resolve(plan.location, "a profile"), controller=False,
                max_duration=cap if plan.max_duration is None else min(plan.max_duration, cap))
        outputs = (Aval(dtypes.STRING, (1,)),) if plan.output else ()
        # It names no devices: it is the session's, on its first one (the default device).
        executable = self.controller.executable(plan, tuple(self.fleet.devices[:1]),
                                                plugin_info("profile", outputs, plan))
        self.programs.keep(executable)
        return executable

    def run(self, executable: Executable, args: Sequence[Array]
            ) -> tuple[list[Array], Callable[[], Awaitable[None]]]:
        """Starts a profile, or stops the one this executable started."""
        if args:
            raise errors.InvalidRequest("a profile request takes no arrays.")
        plan = plan_of(executable, ProfilePlan)
        traces = self._profiles
        trace = traces.pop(executable.id, None)
        if trace is None:
            trace = self._start(plan, executable.id)
            traces[executable.id] = trace
            wait: asyncio.Future[object] = trace.started  # type: ignore[assignment]
        else:
            wait = self._stop(trace)  # type: ignore[assignment]
        outputs = []
        if plan.output:  # what pathwaysutils expects back: one string on the default device
            outputs.append(self.arrays.make_array(
                dtypes.STRING, (1,), sh.Sharding.single(executable.devices[0].id),
                HostData(np.array([trace.directory.encode()], dtype=object))))

        async def status() -> None:
            await asyncio.shield(wait)

        return outputs, status

    def close(self) -> None:
        """The session ends: the profiles it started stop (and are written)."""
        for trace in self._profiles.values():
            self._stop(trace)
        self._profiles.clear()

    def _hosts(self, max_hosts: int) -> list[tuple[WorkerId, str]]:
        """The first `max_hosts` live hosts of the session's devices, in fleet order."""
        hosts: dict[WorkerId, str] = {}
        for device in sorted(self.fleet.devices, key=lambda d: d.id):
            if len(hosts) == max_hosts:
                break
            if device.worker not in hosts and self.fleet.unavailable([device]) is None:
                hosts[device.worker] = f"slice{device.slice_index}-host{device.host_index}"
        return list(hosts.items())

    # ---- starting ------------------------------------------------------------------------

    def _start(self, plan: ProfilePlan, caller: ExecutableId) -> FleetTrace:
        files = self.core.files
        scope = "" if files is None else files.lease
        running: FleetTrace | None = self.controller.profiles.get(scope)
        if running is not None:
            if files is not None:  # the lease's own: its location is this tenant's
                raise errors.ProfileRunning(
                    f"a profile of lease {files.lease}'s workers is being taken already (into "
                    f"{running.directory}); jax's profiler records one at a time per worker: "
                    "stop that one first.")
            raise errors.ProfileRunning(
                f"a profile of the fleet is being taken already (into {running.directory}); "
                "jax's profiler records one at a time: stop that one first.")
        run = plan.run or time.strftime("%Y_%m_%d_%H_%M_%S")  # as jax names its runs
        trace = FleetTrace(plan, caller, self._hosts(plan.max_hosts),
                           f"{plan.location.rstrip('/')}/plugins/profile/{run}", scope)
        self.controller.profiles[scope] = trace

        def start() -> None:
            waits = [self.fleet.channel(w).ask(c.StartProfile(trace.id, plan.options))
                     for w, _ in trace.hosts]
            trace.spawn(self._started(trace, list(trace.hosts), waits))

        self.dispatcher.submit((), start)
        return trace

    async def _started(self, trace: FleetTrace, hosts: list[tuple[WorkerId, str]],
                       waits: list[Awaitable[bool]]) -> None:
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        error = next((e for e in outcomes if isinstance(e, BaseException)), None)
        if error is None and trace.plan.controller:
            try:
                # In an embedded backend the host's start was this process's already.
                trace.own = profiler.PROCESS.start(trace.id, trace.plan.options)
            except errors.IsthmusError as e:
                error = e
        if error is not None:
            for (worker, _), outcome in zip(hosts, outcomes):
                if outcome is True:  # started: drop what it records
                    trace.spawn(_quietly(self.fleet.channel(worker).ask(
                        c.StopProfile(trace.id, "", ""))))
            self._profiles.pop(trace.caller, None)
            if self.controller.profiles.get(trace.scope) is trace:
                del self.controller.profiles[trace.scope]
            failure = as_error(error, "starting the profile")
            trace.started.set_exception(failure)
            trace.started.exception()  # retrieved: the caller's status reports it
            return
        trace.started.set_result(None)
        logger.info("profiling %d hosts%s into %s", len(trace.hosts),
                    " and the controller" if trace.own else "", trace.directory)
        if trace.plan.max_duration is not None:
            trace.timer = asyncio.get_running_loop().call_later(
                trace.plan.max_duration, self._expire, trace)

    def _expire(self, trace: FleetTrace) -> None:
        if self._profiles.get(trace.caller) is trace:
            logger.info("the profile into %s ran its %s s: stopping it", trace.directory,
                        trace.plan.max_duration)
            self._stop(trace)  # the caller's stop then waits for its files

    # ---- stopping ------------------------------------------------------------------------

    def _stop(self, trace: FleetTrace) -> asyncio.Future[list[str]]:
        """Stops `trace` (once; later calls get the same outcome): the files written."""
        if trace.stopped is not None:
            return trace.stopped
        stopped: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        trace.stopped = stopped
        if trace.timer is not None:
            trace.timer.cancel()

        def stop() -> None:
            waits = [self.fleet.channel(w).ask(c.StopProfile(trace.id, trace.directory, label))
                     for w, label in trace.hosts]
            trace.spawn(self._finish(trace, list(trace.hosts), waits, stopped))

        self.dispatcher.submit((), stop)
        return stopped

    async def _finish(self, trace: FleetTrace, hosts: list[tuple[WorkerId, str]],
                      waits: list[Awaitable[str | None]],
                      stopped: asyncio.Future[list[str]]) -> None:
        outcomes: list[object] = []
        try:
            await asyncio.shield(trace.started)
            outcomes = list(await asyncio.gather(*waits, return_exceptions=True))
            if trace.own:
                outcomes.append(await asyncio.get_running_loop().run_in_executor(
                    None, profiler.stop_and_write, trace.id, trace.directory,
                    profiler.host_name("controller")))
            error = next((e for e in outcomes if isinstance(e, BaseException)), None)
        except Exception as e:  # noqa: BLE001 - the start failed: the stop reports why
            error = e
        finally:
            if self.controller.profiles.get(trace.scope) is trace:
                del self.controller.profiles[trace.scope]
        if error is not None:
            failed = [label for (_, label), o in zip(hosts, outcomes)
                      if isinstance(o, BaseException)]
            failure = as_error(error, "writing the profile")
            if failed:
                failure = copy.copy(failure)  # the same error may fail other requests too
                failure.args = (f"the profile of {', '.join(failed)} was not written to "
                                f"{trace.directory}: {failure.message}",)
            stopped.set_exception(failure)
            stopped.exception()
            return
        paths = [p for p in outcomes if isinstance(p, str)]
        logger.info("wrote the profile of %d hosts to %s", len(paths), trace.directory)
        stopped.set_result(paths)


def leave(controller: Controller, slice_index: int) -> None:
    """A slice leaves its lease (a higher priority reclaimed it): its workers stop recording
    the lease's profile at once and drop what they recorded, so that the programs of the
    lease it goes to never enter that profile (which is written without them)."""
    workers = {d.worker for d in controller.fleet.devices if d.slice_index == slice_index}
    for trace in list(controller.profiles.values()):
        leaving = [w for w, _ in trace.hosts if w in workers]
        if not leaving:
            continue
        # A new list: a start or stop under way keeps the hosts it was sent to.
        trace.hosts = [(w, label) for w, label in trace.hosts if w not in workers]
        for worker in leaving:
            trace.spawn(_quietly(controller.fleet.channel(worker).ask(
                c.StopProfile(trace.id, "", ""))))
        logger.info("slice %s left the profile into %s: its hosts' records are dropped",
                    slice_index, trace.directory)


async def _quietly(outcome: Awaitable[object]) -> None:
    try:
        await outcome
    except Exception:  # noqa: BLE001 - dropping a profile that failed to start anyway
        pass
