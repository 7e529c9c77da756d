"""The controller: one per head process, shared by every session.

It owns the fleet, the ledger of buffer groups and the arrays holding them (ledger.py), hands
out executable ids, and caches compiled programs by (program, options, devices) so that two sessions
compiling the same step share one executable. A program that crashed a worker process
(`crashed`) is refused from then on, on any devices (`program_digest`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from collections.abc import Awaitable
from typing import Any, cast

from isthmus import errors
from isthmus.controller import specs
from isthmus.controller.counts import Counts
from isthmus.controller.executables import Executable, ExecutableState, ProgramPlan, hosted
from isthmus.controller.fleet import Device, LostChannel, WholeFleet
from isthmus.controller.ledger import Ledger
from isthmus.controller.vetting import ProgramVetter, Vetted
from isthmus.dtypes import DType
from isthmus.ids import ExecutableId, WorkerId
from isthmus.logs import event
from isthmus.transport import commands as c
from isthmus.transport.base import WorkerChannel
from isthmus.transport.messages import CrashReport, dtype_name
from isthmus.transport.records import ColocatedProgram, CompiledInfo, CompileRequest
from isthmus.worker.programs import canonical_digest

logger = logging.getLogger(__name__)

SHOWN_NAME = 128  # characters of a program's name in logs, events (the live page), messages


def shown(name: str) -> str:
    """A program's name (its client's module's, of any length) as logs and pages show it."""
    return name if len(name) <= SHOWN_NAME else f"{name[:SHOWN_NAME]}... ({len(name)} characters)"


# The largest trial-compiled executable sent to the hosts to load (larger: they compile).
VETTED_EXECUTABLE_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Limits and timeouts of the controller."""

    host_buffer_timeout: float = 30.0  # seconds a request waits for host data to start arriving
    max_array_bytes: int = 1 << 40  # larger arrays are refused with RESOURCE_EXHAUSTED
    compile_cache_size: int = 256  # executables kept after every session released them
    # Check the ledger's and the executables' records after every request
    # (`Controller.validate`; `--validate`, on in the test suite): a bookkeeping bug fails
    # the request that caused it.
    validate: bool = False
    # Moves of shards kept with their causes, for `isthmus status --buffer` (0: none kept).
    transitions: int = 4096


LAYOUTS_KEPT = 4096  # default layouts known (`Controller.default_layout`), oldest out first


class Controller:
    """Fleet, ledger, executables and the compilation cache."""

    def __init__(self, fleet: WholeFleet, config: ControllerConfig | None = None,
                 vetter: ProgramVetter | None = None) -> None:
        self.fleet = fleet
        self.config = config or ControllerConfig()
        self._executable_ids = itertools.count(1)
        self._private_keys = itertools.count(1)
        # The buffer groups and the arrays that hold them.
        self.ledger = Ledger(fleet, self.config.transitions)
        self._executables: dict[bytes, Executable] = {}
        self._idle: dict[bytes, Executable] = {}  # released executables, oldest first
        self._dispatches = itertools.count(1)
        # Programs that crashed a worker: `program_digest` -> why they are refused.
        self._refused: dict[bytes, str] = {}
        self._digests: dict[bytes, bytes] = {}  # SHA-256 of a program -> its program_digest
        # Client programs are parsed first in a disposable process (the trust boundary).
        self.vetter = vetter or ProgramVetter()
        # The hosts load what the vetting process compiled (a CPU fleet's programs) instead
        # of compiling it again (set by `head`: the embedded backend, and a fleet that is not
        # a shared service); up to VETTED_EXECUTABLE_BYTES, since each host is sent it.
        self.loads_vetted = False
        self.sessions: set[object] = set()
        # The profiles being taken (session_profiles.py), by scope: "" the fleet's, or the id
        # of the lease whose workers it covers (a shared service: one per lease at a time).
        self.profiles: dict[str, Any] = {}
        self.counts = Counts()  # for the metrics (isthmus/observe)
        # The backends' default layouts: (dtype, shape, device kind, memory kind) -> layout.
        self._layouts: dict[tuple[str, tuple[int, ...], str, str], str] = {}

    # ---- layouts -------------------------------------------------------------------------

    def known_layout(self, dtype: DType, shape: tuple[int, ...], device: Device,
                     memory_kind: str = "") -> str | None:
        """The default layout if it is known without asking a host (`default_layout`)."""
        layout = self.default_layout(dtype, shape, device, memory_kind, ask=False)
        return layout if isinstance(layout, str) else None

    def default_layout(self, dtype: DType, shape: tuple[int, ...], device: Device,
                       memory_kind: str = "", ask: bool = True) -> str | Awaitable[str] | None:
        """The serving backend's default layout of such an array on `device`, as XLA writes
        it: asked of its host once per (dtype, shape, device kind, memory kind), then known.
        A CPU device's is row-major ("{1,0}"), known without asking."""
        key = (dtype.kind, shape, device.kind, memory_kind)
        known = self._layouts.get(key)
        if known is not None:
            return known
        if device.platform == "cpu" or dtype.numpy is None:
            return "{" + ",".join(str(i) for i in range(len(shape) - 1, -1, -1)) + "}"
        if not ask:
            return None
        answer = self.fleet.channel(device.worker).ask(
            c.DefaultLayout(dtype_name(dtype.numpy), shape, int(device.id)))

        async def asked() -> str:
            layout = await answer
            if len(self._layouts) >= LAYOUTS_KEPT:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
            return layout

        return asked()

    # ---- programs ------------------------------------------------------------------------

    def executable(self, request: ProgramPlan, devices: tuple[Device, ...],
                   info: CompiledInfo | None = None) -> Executable:
        """The executable for a program on devices: cached, or compiling from now on.

        A *private* program (colocated Python, a persistence plan) is never shared: it
        belongs to the session that sent it (its code runs for that session's arrays only),
        and it is unloaded as soon as that session releases it. `info` describes it (its
        hosts only unpickle it, or have nothing to load)."""
        if request.private or not isinstance(request, CompileRequest):
            key = b"python:%d" % next(self._private_keys)
        else:
            key = hashlib.sha256(request.module).digest() + hashlib.sha256(
                request.compile_options).digest() + repr([d.id for d in devices]).encode() + (
                request.namespace.encode())
            if self._refused:
                refused = self._refused.get(self.program_digest(key, request))
                if refused is not None:
                    raise errors.ProgramRefused(refused)
        executable = self._executables.get(key)
        if executable is not None and executable.error is None:
            if executable.state is ExecutableState.IDLE:
                del self._idle[key]
                compiled = executable.compiled
                executable.move(ExecutableState.READY if compiled is not None and compiled.done()
                                else ExecutableState.COMPILING)
            executable.refs += 1
            self.counts.compile_hits += 1
            return executable
        down = self.fleet.unavailable(devices)
        if down is not None:
            raise down
        executable = Executable(ExecutableId(next(self._executable_ids)), key, devices, request)
        if not request.private:
            self.counts.compile_misses += 1
        executable.workers = self.fleet.worker_set(executable.parts)
        executable.refs = 1
        if info is not None:  # known before (a plan's, or a program kept across a restart)
            specs.work_out(executable, info)
        self._executables[key] = executable
        if request.on_hosts:  # compiled (a colocated function: unpickled) there
            executable.compiled = asyncio.get_running_loop().create_task(
                self._compile(executable, hosted(executable)))
        else:
            executable.compiled = asyncio.get_running_loop().create_future()
            # A program that is not compiled on the hosts comes with its info.
            executable.compiled.set_result(cast(CompiledInfo, info))
        return executable

    def validate(self, cause: str) -> None:
        """Validate mode: raises InternalError (and logs it, marked "isthmus validate:")
        where the ledger's or the executables' records disagree after `cause` (a request's
        kind and op id)."""
        try:
            self.ledger.validate_state()
            self.validate_executables()
        except AssertionError as e:
            logger.error("isthmus validate: after %s the controller's records disagree: %s",
                         cause, e)
            raise errors.InternalError(
                f"validate mode: after {cause} the controller's records disagree ({e}); this "
                "is a bug in isthmus: please report it with the server log.") from None

    async def validate_hosts(self, wait: float = 5.0, answer: float = 1.0
                             ) -> tuple[int, list[str]]:
        """Validate mode, at stop, every session closed: what each live host holds against
        the ledger. A buffer a host holds that the ledger freed is a leak; one the ledger has
        not freed that its host lacks is a record of bytes that are not there. The hosts are
        asked at once; one that does not answer within `answer` s (lost, leaving, or busy
        re-forming its collective group) is passed over. Frees may still be queued behind a
        collective program, so hosts that disagree are asked again for up to `wait` s.
        Returns how many hosts answered, and what disagrees (a line per host and direction;
        empty: all agree)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait

        async def held(worker: WorkerId, channel: WorkerChannel) -> set[int] | None:
            try:
                return set(await asyncio.wait_for(channel.ask(c.Held()), answer))
            except (errors.IsthmusError, TimeoutError) as e:
                logger.debug("validate: host %s did not say what it holds: %r", worker, e)
                return None

        asking = {w: ch for w, ch in sorted(self.fleet.workers.items())
                  if not isinstance(ch, LostChannel)}
        found: dict[WorkerId, tuple[list[int], list[int]]] = {}  # leaked, missing
        while asking:
            answers = await asyncio.gather(*(held(w, ch) for w, ch in asking.items()))
            expected = self.ledger.not_freed()
            for worker, holds in zip(list(asking), answers):
                if holds is None:  # passed over, whatever it said before
                    del asking[worker]
                    found.pop(worker, None)
                    continue
                mine = expected.get(worker, set())
                found[worker] = (sorted(holds - mine), sorted(mine - holds))
                if found[worker] == ([], []):
                    del asking[worker]
            if not asking or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        problems = []
        for worker, (leaked, missing) in sorted(found.items()):
            if leaked:
                problems.append(f"host {worker} still holds {len(leaked)} buffers the "
                                f"controller freed: {leaked[:20]}")
            if missing:
                problems.append(f"host {worker} lacks {len(missing)} buffers the controller "
                                f"has not freed: {missing[:20]}")
        return len(found), problems

    def validate_executables(self) -> None:
        """Raises AssertionError where the executables' records disagree: one listed under
        another's key, a negative count of holders, a listed one failed or dropped, an idle
        one held or not kept idle, a held one released by all, more idle than the cache
        keeps."""
        for key, executable in self._executables.items():
            assert executable.key == key, f"executable {executable.id} listed under another key"
            refs, state = executable.refs, executable.state
            assert refs >= 0, f"executable {executable.id} has {refs} holders"
            if state is ExecutableState.IDLE:
                assert refs == 0, f"idle executable {executable.id} has {refs} holders"
                assert key in self._idle, f"executable {executable.id} is idle but not kept"
            else:
                assert state in (ExecutableState.COMPILING, ExecutableState.READY), (
                    f"executable {executable.id} is {state.value} but still listed")
                assert refs > 0, (
                    f"executable {executable.id} is held by no session but is {state.value}")
        for key, executable in self._idle.items():
            assert self._executables.get(key) is executable, (
                f"idle executable {executable.id} is not the one listed")
            assert executable.refs == 0, (
                f"idle executable {executable.id} has {executable.refs} holders")
        assert len(self._idle) <= self.config.compile_cache_size, (
            f"{len(self._idle)} idle executables, more than the {self.config.compile_cache_size} "
            "kept")

    def ensure_loaded(self, executable: Executable) -> None:
        """Gives the program to every current worker of `executable` that lacks it (one that
        replaced a lost worker), ahead of the Execute being dispatched. Called at dispatch
        time, so it sees the channels the Execute will go to; O(1) while the fleet is
        unchanged. A refused program is refused to them instead (their Executes fail)."""
        executable.dispatched = next(self._dispatches)
        if executable.epoch == self.fleet.epoch:
            return
        refused = executable.refused
        for worker in executable.parts:
            channel = self.fleet.channel(worker)
            if executable.holders.get(worker) is not channel:
                if refused is None:
                    channel.send(c.Load(executable.id, hosted(executable)))
                else:
                    channel.send(c.Refuse(executable.id, tuple(executable.device_ids),
                                          errors.ProgramRefused(refused)))
                executable.holders[worker] = channel
        executable.epoch = self.fleet.epoch

    async def vet(self, module: bytes, options: bytes, devices: int) -> Vetted:
        """A client's program as this server writes it (`ProgramVetter`; compiled once there
        for a CPU fleet): only these bytes reach `executable`, and so the workers' parser
        and compiler; its canonical digest, which names it in the hosts' caches; and the
        executable compiled there, for the hosts to load (`loads_vetted`; else empty)."""
        # A GPU fleet's programs are only parsed and written: CPU cannot compile for them.
        trial = options if self.fleet.platform == "cpu" else b""
        vetted = await self.vetter.vet(module, trial, devices)
        self._digests[hashlib.sha256(vetted.module).digest()] = vetted.digest
        executable = vetted.executable if self.loads_vetted else b""
        if len(executable) > VETTED_EXECUTABLE_BYTES:
            executable = b""
        return dataclasses.replace(vetted, executable=executable)

    def program_digest(self, key: bytes, request: CompileRequest) -> bytes:
        """What names a program for refusing it: the SHA-256 of its bytes without debug
        information (`canonical_digest`), so that the same function from another script, or
        at another line, is the same program; and not its options, which carry the device
        assignment: a program refused on some devices is refused on all. Parsing costs a
        few ms per program; only done while some program is refused, once per program."""
        raw = key[:32]  # the SHA-256 of the program's bytes
        digest = self._digests.get(raw)
        if digest is None:
            try:
                digest = canonical_digest(request.module)
            except Exception:  # noqa: BLE001 - it does not parse: it will not compile either
                digest = raw
            self._digests[raw] = digest
        return digest

    def last_program(self, worker: WorkerId) -> str | None:
        """The name of the last program dispatched to `worker`, if the controller still
        knows it (for the error of a worker that was lost)."""
        last: Executable | None = None
        for executable in self._executables.values():
            if executable.dispatched and worker in executable.parts and (
                    last is None or executable.dispatched > last.dispatched):
                last = executable
        return shown(last.info.name) if last is not None and last.info is not None else None

    def crashed(self, report: CrashReport, where: str) -> None:
        """A worker process died of a fatal signal while dispatching `report.executable`
        (its successor in the slot says so; `where` names the worker): that program is
        refused from now on, on every device, until this process ends. Its executables are
        refused to their workers now (their Executes fail there) and to workers that join
        later (`ensure_loaded`); its Compile is refused here (`executable`)."""
        executable = next((e for e in self._executables.values()
                           if e.id == report.executable), None) if report.executable else None
        if executable is None or not isinstance(executable.request, CompileRequest) or (
                executable.request.private):
            logger.warning("worker %s died of a fatal signal (%s) %s; see its log", where,
                           report.fatal, f"while dispatching executable {report.executable}, "
                           "which this controller no longer knows" if report.executable
                           else "outside any program")
            return
        digest = self.program_digest(executable.key, executable.request)
        if digest in self._refused:
            return
        name = executable.info.name if executable.info is not None else "(unnamed)"
        self._refused[digest] = message = (
            f"program {shown(name)} crashed worker {where} with "
            f"\"{report.fatal or 'a fatal signal'}\"; this server refuses to compile or run it "
            "until its controller restarts. Change the program or its inputs (the worker's "
            "log has the fatal traceback), or restart the controller to try it again.")
        logger.warning("%s", message, extra=event("program_refused", program=shown(name)))
        for other in self._executables.values():
            # The same program has the same name (the module's): only those are digested.
            if other is executable or (
                    other.info is not None and other.info.name == name
                    and isinstance(other.request, CompileRequest) and not other.request.private
                    and self.program_digest(other.key, other.request) == digest):
                other.refused = message
                other.epoch = -1  # `ensure_loaded` refuses it to workers that join later
                for worker in other.parts:
                    channel = self.fleet.channel(worker)
                    channel.send(c.Refuse(other.id, tuple(other.device_ids),
                                          errors.ProgramRefused(message)))
                    other.holders[worker] = channel

    async def _compile(self, executable: Executable,
                       request: CompileRequest | ColocatedProgram) -> CompiledInfo:
        executable.epoch = self.fleet.epoch
        channels = {worker: self.fleet.channel(worker) for worker in executable.parts}
        executable.holders = dict(channels)
        waits = [channel.ask(c.Compile(executable.id, request)) for channel in channels.values()]
        try:
            infos = await asyncio.gather(*waits)
        except errors.IsthmusError as e:
            self._failed(executable, e)
            raise
        except Exception as e:  # noqa: BLE001
            error = errors.from_runtime_error(e, errors.CompileError, "compilation failed")
            self._failed(executable, error)
            raise error from None
        if executable.info is None and infos[0] is not None:
            specs.work_out(executable, infos[0])
        if isinstance(request, CompileRequest) and request.executable:
            # Loaded from the vetting process's executable: a later Load compiles it again.
            executable.request = dataclasses.replace(request, executable=b"")
        info = executable.info
        if info is None:
            raise errors.InternalError(
                "the workers compiled the program but described none of it; this is a bug in "
                "isthmus: please report it.")
        logger.info("compiled %s for devices %s", shown(info.name), executable.device_ids,
                    extra=event("compiled", program=shown(info.name),
                                devices=len(executable.devices)))
        if executable.state is ExecutableState.COMPILING:  # idle or dropped: stays so
            executable.move(ExecutableState.READY)
        return info

    def program_text(self, executable: Executable) -> Awaitable[str] | None:
        """The compiled program's text (the client's `as_text()`), asked of one of its hosts
        now, not at its compile; None for a plan that compiles no program (it has none)."""
        channel = self._describer(executable)
        return None if channel is None else channel.ask(c.ProgramText(executable.id))

    def cost_analysis(self, executable: Executable) -> Awaitable[dict[str, object]] | None:
        """XLA's cost analysis of the compiled program, as `program_text` asks for its text;
        None for a plan that compiles no program."""
        channel = self._describer(executable)
        return None if channel is None else channel.ask(c.CostAnalysis(executable.id))

    def _describer(self, executable: Executable) -> WorkerChannel | None:
        """The channel of the host asked about a compiled program: the first of its workers
        that is up (a worker that replaced a lost one is given the program first)."""
        if not isinstance(executable.request, CompileRequest):
            return None
        self.ensure_loaded(executable)
        channels = [self.fleet.channel(worker) for worker in executable.parts]
        return next((ch for ch in channels if not isinstance(ch, LostChannel)), channels[0])

    def _failed(self, executable: Executable, error: errors.IsthmusError) -> None:
        """Its compile failed: no longer listed (a later compile of the program starts
        afresh), nor kept idle."""
        executable.error = error
        if executable.state is ExecutableState.DROPPED:
            return  # evicted while compiling: another may be listed under its key now
        if self._executables.get(executable.key) is executable:
            del self._executables[executable.key]
        self._idle.pop(executable.key, None)
        executable.move(ExecutableState.FAILED)

    def release_executable(self, executable: Executable) -> None:
        executable.refs -= 1
        if executable.refs > 0 or executable.error is not None:
            return
        if executable.request.private:
            self._executables.pop(executable.key, None)
            self.counts.retire(executable.slices, executable.runs)
            executable.move(ExecutableState.DROPPED)
            if executable.request.on_hosts:
                for worker in executable.parts:
                    self.fleet.channel(worker).send(c.DropExecutable(executable.id))
            return
        executable.move(ExecutableState.IDLE)
        self._idle[executable.key] = executable
        while len(self._idle) > self.config.compile_cache_size:
            key = next(iter(self._idle))
            old = self._idle.pop(key)
            self._executables.pop(key, None)
            self.counts.retire(old.slices, old.runs)
            old.move(ExecutableState.DROPPED)
            for worker in old.parts:
                self.fleet.channel(worker).send(c.DropExecutable(old.id))

    def program_runs(self) -> dict[int, int]:
        """Slice -> Executes dispatched on it (a program over several slices counts on
        each), since this controller started."""
        runs = dict(self.counts.retired_runs)
        for executable in self._executables.values():
            if executable.runs:
                for s in executable.slices:
                    runs[s] = runs.get(s, 0) + executable.runs
        return runs

    def stats(self) -> dict[str, object]:
        """Per worker: what the controller accounts ("buffers", "bytes") beside what the
        worker itself reports ("worker_buffers", "worker_bytes")."""
        workers: dict[str, dict[str, int]] = {}
        for worker, account in self.ledger.accounting().items():
            reported = self.fleet.channel(worker).stats()
            workers[str(worker)] = {
                **account, "worker_buffers": reported.get("buffers", 0),
                "worker_bytes": reported.get("bytes", 0),
                "worker_executables": reported.get("executables", 0),
                **{k: v for k, v in reported.items()
                   if k.startswith(("device_", "compile_cache_"))}}
        vetter = self.vetter
        return {"workers": workers, "executables": len(self._executables),
                "vetting": {"trial_compiles": vetter.trial_compiles,
                            "trials_skipped": vetter.trials_skipped,
                            "record_hits": vetter.record.hits if vetter.record else 0}}
