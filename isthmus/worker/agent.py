"""The worker process: one host of the fleet.

It registers with the controller, sends heartbeats, and applies the controller's commands
to its `DeviceHost` in the order they arrive. Everything that waits (compiles, readiness,
host copies, peer transfers) runs as a task, so commands keep flowing; the controller only
sends a command once what it depends on is in place.

The jaxlib client is made when the controller forms a collective group; when the group
re-forms (a peer was lost or a worker joined) a new client replaces it and the buffers move
across (`DeviceHost.adopt`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable

from isthmus import errors, gctune
from isthmus.compat.jaxlib_types import DistributedClient, JaxlibClient
from isthmus.ids import COMPANION_BASE
from isthmus.transport import auth
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.auth import Unauthenticated
from isthmus.transport.links import ControllerLink, PeerClient, PeerDataServer, Pulse
from isthmus.transport.tls import TlsConfig
from isthmus.worker import scheduling, supervise
from isthmus.worker.applying import CommandApplier
from isthmus.worker.compile_cache import CompileCache, KeptExecutables
from isthmus.worker.crashes import CrashConfig, CrashRecord
from isthmus.worker.host import DeviceHost
from isthmus.worker.incidents import IncidentForwarder, own_log_path
from isthmus.worker.membership import (
    EXIT_CONTROLLER_LOST,
    EXIT_REFUSED,
    EXIT_SHUTDOWN,
    Failed,
    GroupActive,
    GroupCalled,
    Membership,
    Phase,
    Refused,
    Stop,
    StreamEnded,
    Welcomed,
)
from isthmus.worker.platforms import (
    EXIT_PLATFORM_UNAVAILABLE,
    Description,
    Platform,
    PlatformUnavailable,
    companion_devices,
    describe,
    join_group,
)
from isthmus.worker.process import exit_now, preload, watch_stop_signals
from isthmus.worker.reading import Turns, probe_found, unpack
from isthmus.worker.simulated import make_host

logger = logging.getLogger(__name__)

EXIT_DROPPED = 4  # declared lost while alive, with no way to start afresh (no argv)
STOP_GRACE = 5.0  # seconds a signalled worker may take to stop before it just exits
# Seconds a request whose collective lost a peer waits for the controller to say which.
LOSS_REASON_WAIT = 3.0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    controller: str  # HOST:PORT of the controller, or unix:PATH (a fleet without TCP)
    slice_index: int = -1  # -1: any slice with a free host slot
    devices: int = 4  # CPU devices (a CUDA worker serves the GPUs it sees)
    platform: Platform = Platform()
    # Address of the peer data server; unix:DIR serves it on a Unix socket in DIR (a fleet
    # on one machine without TCP; the default when the controller is unix:PATH).
    listen: str = "127.0.0.1"
    advertise: str | None = None  # how peers reach it (default: `listen`)
    connect_timeout: float = 180.0  # seconds to wait for the controller (at start, or back)
    group_timeout: int = 60  # seconds to join a collective group
    gloo_scheduling: str = scheduling.DEFAULT  # of a CPU group's gloo loop thread
    token: str = ""  # the fleet's shared secret ("": a fleet on a network it trusts), or a
    #   single-use join token of a shared service's launched worker (`transport/auth.py`)
    tls: TlsConfig | None = None  # mutual TLS with the controller and peers
    # The command line that starts this worker afresh (a worker the controller declared
    # lost while it was alive replaces itself with it); empty: it exits instead.
    argv: tuple[str, ...] = ()
    crash: CrashConfig = CrashConfig()  # crash records of its slot (`worker/crashes.py`)


class WorkerAgent:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.host: DeviceHost | None = None
        # Applies the controller's commands to the host (`applying.py`).
        self.applier = CommandApplier(self)
        # Where it stands with the fleet (registering, joined, forming a group, in one,
        # stopping), what the group being formed lacks, the commands applied and acked.
        self.membership = Membership()
        self._settled = False  # gctune.settle() done
        # The group joined by the last FormGroup, until its DeviceMap makes it active:
        # (generation, its jaxlib client, its colocated CPU devices' client or None).
        self._next: tuple[int, JaxlibClient, JaxlibClient | None] | None = None
        self._keep: list[DistributedClient] = []  # those of past groups stay alive
        self.crashes = CrashRecord(config.crash)
        cache = config.platform.compile_cache
        # Executables this process compiled, kept across its collective groups (and in the
        # persistent cache when there is one).
        self._compile_cache = KeptExecutables(CompileCache(cache) if cache is not None
                                              else None)
        self._tasks: set[asyncio.Task[None]] = set()
        # Requests that wait for computations (Ready, Fetch, FetchFile) and their tasks: when
        # the group re-forms, those still waiting are asked again of the new host, where a
        # computation stuck on a lost peer has become an error (it would never finish here).
        self._waits: dict[int, tuple[m.Ask | m.FetchFile, asyncio.Task[None]]] = {}
        self.link = ControllerLink(config.controller, config.token, config.tls)
        self.peers = PeerClient(config.tls)
        self._data = PeerDataServer(self.applier.serve_buffer, config.tls)
        self._pulse: Pulse | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._described: Description | None = None  # read off a client at start
        # Messages read, waiting to be applied (None: the stream ended).
        self._queue: asyncio.Queue[object] | None = None
        self.log_path = own_log_path()  # named in errors and in the controller's log

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self) -> int:
        loop = self._loop = asyncio.get_running_loop()  # for `stop_soon` from other threads
        crash = self.crashes.take()  # how this slot's last process died, if it crashed
        self.crashes.arm()
        # Heavy imports now, before registering: later they would hold the GIL and silence
        # the heartbeats.
        await loop.run_in_executor(None, preload)
        try:
            described = await loop.run_in_executor(
                None, describe, self.config.platform, self.config.devices)
        except PlatformUnavailable as e:
            logger.error("%s", e)
            return EXIT_PLATFORM_UNAVAILABLE
        self._described = described
        data_address = await self._data.start(self.config.listen, self.config.advertise)
        register = m.Register(m.PROTOCOL_VERSION, self.config.slice_index, described.devices,
                              described.platform, described.device_kind, data_address,
                              socket.gethostname(), os.getpid(), described.memory_kinds,
                              described.companions, crash, self.log_path,
                              described.attributes)
        membership = self.membership
        while membership.active:
            await self._serve(register)
            if membership.welcomed:
                register = dataclasses.replace(register, crash=None)  # reported once
            if membership.phase is Phase.ENDED:  # refused, or no controller to be reached
                break
            # A join token is used up once welcomed: its launcher starts a fresh worker.
            stopping = membership.stopping
            membership.handle(StreamEnded(reusable=not auth.is_join_token(self.config.token)))
            if membership.phase is Phase.ENDED:
                if not stopping:
                    logger.info("membership ended; exiting for a fresh worker to take the slot")
                break
            # The controller dropped us (or went away): start afresh and register again; a
            # controller that is really gone makes the next connection attempt fail.
            self._reset()
            await asyncio.sleep(1.0)
        if self._pulse is not None:
            self._pulse.stop()
        await self._data.stop()
        await self.peers.close()
        await self._flush_executables()
        return membership.exit_code

    async def _flush_executables(self, wait: float = 10.0) -> None:
        """The executables compiled last are written to the compile cache before the process
        ends (a worker started again in this slot, or a fleet restarted, loads them)."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self._compile_cache.flush, wait)
        except Exception:  # noqa: BLE001 - a cache is an optimisation
            logger.warning("the compile cache's last writes did not finish within %g s", wait)

    @property
    def exit_code(self) -> int:
        return self.membership.exit_code

    async def _serve(self, register: m.Register) -> None:
        """One membership: register, obey, until the stream ends (or it is refused)."""
        self.link = ControllerLink(self.config.controller, self.config.token,
                                   self.config.tls)
        try:
            messages = await self.link.open(register, self.config.connect_timeout)
            welcome = await messages.__anext__()
        except Unauthenticated as e:
            logger.error("the controller at %s refused this worker: %s", self.config.controller,
                         e)
            await self.link.close()
            self.membership.handle(Refused(EXIT_REFUSED))
            return
        except (TimeoutError, StopAsyncIteration, Exception) as e:  # noqa: BLE001
            code = getattr(e, "code", None)
            why = code().name if callable(code) else (str(e) or type(e).__name__)
            logger.error("cannot reach the controller at %s within %g s (%s); check that it "
                         "runs and that --controller is its address", self.config.controller,
                         self.config.connect_timeout, why)
            await self.link.close()
            self.membership.handle(Refused(EXIT_CONTROLLER_LOST))
            return
        if isinstance(welcome, m.Refused):
            logger.error("the controller refused this worker: %s", welcome.reason)
            await self.link.close()
            self.membership.handle(Refused(EXIT_REFUSED))
            return
        logger.info("joined as slice %s host %s", welcome.slice_index, welcome.host_index)
        self.membership.handle(Welcomed())
        self.crashes.joined(welcome.controller)
        self._loop = asyncio.get_running_loop()
        if self._pulse is None:
            self._pulse = Pulse(self.config.controller, welcome.heartbeat_interval,
                                self._on_pulse)
            self._pulse.start()
        self._pulse.token = welcome.token or None
        self._data.key = welcome.data_key
        if welcome.shared_probe is not None and probe_found(*welcome.shared_probe):
            self.link.send(m.SharedDir(os.path.dirname(welcome.shared_probe[0])))
        loop = asyncio.get_running_loop()
        # This membership's errors also go to the controller's log (`incidents.py`).
        forwarder = IncidentForwarder(self.link.send, loop)
        logging.getLogger().addHandler(forwarder)
        heartbeat = loop.create_task(self._heartbeat(welcome.heartbeat_interval))
        queue = self._queue = asyncio.Queue()
        applying = loop.create_task(self._apply_in_order(queue))
        reader = loop.create_task(self._read(messages, queue, applying))
        stopped = asyncio.ensure_future(self.membership.ending.wait())
        # A command loop that failed ends the membership (logged in `_apply_in_order`): the
        # controller sees the stream close, fails what this worker held with DATA_LOSS, and
        # this process registers afresh, instead of leaving its requests unanswered.
        await asyncio.wait([reader, applying, stopped], return_when=asyncio.FIRST_COMPLETED)
        if self._pulse is not None:
            self._pulse.token = None
        for task in (heartbeat, reader, applying, stopped, *self._tasks):
            task.cancel()
        await self.link.close()
        logging.getLogger().removeHandler(forwarder)
        self._queue = None

    def _reset(self) -> None:
        """Forgets everything of the last membership (its buffers are gone for the fleet)."""
        self.host = None
        self._next = None
        self.applier.reset()
        self._tasks.clear()

    def stop(self, code: int = EXIT_SHUTDOWN) -> None:
        if code == EXIT_SHUTDOWN:
            supervise.told_to_stop()
        self.membership.handle(Stop(code))

    def stop_soon(self, reason: str) -> None:
        """Stops from any thread; exits outright if the event loop does not get there within
        STOP_GRACE (it may be stuck in jaxlib on a computation that waits for a lost peer)."""
        logger.info("stopping: %s", reason)
        supervise.told_to_stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stop)
        timer = threading.Timer(STOP_GRACE, exit_now, (EXIT_SHUTDOWN,))
        timer.daemon = True
        timer.start()

    def _on_pulse(self, answer: bytes) -> None:
        """The controller's answer to a pulse (in the pulse thread)."""
        if answer == m.ALIVE_STOP:
            self.stop_soon("the controller is stopping")
        elif answer == m.ALIVE_DROPPED:
            # The controller declared this worker lost (it was silent too long: stopped,
            # swapped out, starved). Its buffers and group are gone for the fleet; acting on
            # commands still queued here could block on peers that moved on. Start afresh.
            logger.warning("the controller declared this worker lost; starting afresh")
            self.restart_process()

    def restart_process(self) -> None:
        for handler in logging.getLogger().handlers:
            handler.flush()
        if not self.config.argv:
            exit_now(EXIT_DROPPED)
        os.execv(self.config.argv[0], list(self.config.argv))

    async def _heartbeat(self, interval: float) -> None:
        while True:
            queued = self._queue.qsize() if self._queue is not None else 0
            self.link.send(m.Heartbeat(self.host.stats() if self.host else {},
                                       self.membership.acknowledge(), queued,
                                       self.applier.applying))
            await asyncio.sleep(interval)

    async def _read(self, messages: AsyncIterator[object], queue: asyncio.Queue[object],
                    applying: asyncio.Task[None]) -> None:
        """Reads the stream while `_apply_in_order` applies it, so that a FormGroup is seen
        even while the commands wait for a computation of the group it replaces."""
        try:
            async for message in messages:
                if isinstance(message, m.FormGroup):
                    self.membership.handle(GroupCalled(message.generation,
                                                       frozenset(message.gone), message.reason))
                queue.put_nowait(message)
            queue.put_nowait(None)
            await applying
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the controller is gone or dropped us
            logger.warning("the stream to the controller ended: %s", e)
        finally:
            applying.cancel()

    async def _apply_in_order(self, queue: asyncio.Queue[object]) -> None:
        """Applies what `_read` queues, in order. A command that fails is refused by itself
        (`_refuse`); anything else that raises here is a bug that leaves this worker's
        state unknown: it is logged (and so reaches the controller) and ends the loop, and
        with it the membership (`_serve`)."""
        turns = Turns()
        while (message := await turns.next(queue)) is not None:
            try:
                await self._handle(message)
            except Exception as e:
                where = f" ({self.log_path})" if self.log_path else ""
                logger.exception(
                    "the worker could not apply a %s and leaves the fleet to register afresh "
                    "(arrays it held are lost); this is a bug in isthmus: please report it "
                    "with this log%s", type(message).__name__, where)
                for leaving in self.membership.handle(Failed(
                        f"it left the fleet: "
                        f"{e if isinstance(e, errors.IsthmusError) else repr(e)}; this is a "
                        f"bug in isthmus: please report it with the worker's log{where}")):
                    self.link.send(leaving)
                raise
            finally:
                self.applier.applying = ""

    # ---- messages ------------------------------------------------------------------------

    async def _handle(self, message: object) -> None:
        if isinstance(message, m.Batch):
            applier, membership = self.applier, self.membership
            for command in unpack(message.commands):
                try:
                    if not applier.apply_now(command):
                        await applier.apply_command(command)
                except Exception as e:  # refused with the cause, see `refuse`
                    applier.refuse(command, e)
                    if (isinstance(command, c.Execute) and self.host is not None
                            and not isinstance(e, errors.IsthmusError)
                            and self.host.collectives.spans_others(command.executable)):
                        # The parts of the program on other hosts wait for this one in their
                        # collectives, forever: only a re-formed group ends their wait.
                        raise errors.InternalError(
                            f"its part of program {command.executable}, which spans other "
                            f"hosts, failed ({type(e).__name__}: {e}), and the other parts "
                            "would wait for it forever") from e
                applier.applying = ""
                if (ack := membership.count(m.weight(command))) is not None:
                    self.link.send(ack)
        elif isinstance(message, m.FormGroup):
            self.applier.applying = f"joining collective group {message.generation}"
            await self._form(message)
        elif isinstance(message, m.DeviceMap):
            self.applier.applying = "moving buffers into the new collective group"
            await self._activate(message.mapping)
        elif isinstance(message, m.Shutdown):
            logger.info("shutting down: %s", message.reason)
            self.stop(EXIT_SHUTDOWN)
        else:
            logger.warning("unexpected message %s", type(message).__name__)

    def reply(self, request: int, value: object = None,
              error: errors.IsthmusError | None = None) -> None:
        self.link.send(m.Reply(request, value, error))

    def spawn(self, request: int, work: Awaitable[object],
              command: m.Ask | m.FetchFile | None = None) -> None:
        """Runs `work` as a task and answers `request` with its outcome. With `command`
        (a wait for computations), the request is asked again if the group re-forms."""
        if command is None and isinstance(work, asyncio.Future) and work.done() \
                and not work.cancelled():
            error = work.exception()  # the usual small put: stored already, answered now
            if error is None:
                self.reply(request, work.result())
                return
            if isinstance(error, errors.IsthmusError) \
                    and not isinstance(error, errors.PeerFailure):
                self.reply(request, error=error)
                return

        async def run() -> None:
            try:
                value = await work
            except errors.PeerFailure as e:
                # The transport noticed the loss before the controller's FormGroup arrived:
                # wait (briefly) to name the lost worker, as arrays of the lost slice do.
                reason = await self._loss_reason()
                self.reply(request, error=errors.WorkerLost(
                    f"the computation producing this array spanned a worker that was lost "
                    f"({reason}); recreate it, or continue on the slices that are up. "
                    f"[{e.message}]" if reason else e.message))
            except errors.IsthmusError as e:
                self.reply(request, error=e)
            except Exception as e:
                logger.exception("request %s failed", request)
                self.reply(request, error=errors.InternalError(
                    f"the worker failed unexpectedly ({type(e).__name__}: {e}); this is a "
                    "bug in isthmus: please report it with the worker log."))
            else:
                self.reply(request, value)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if command is not None:
            self._waits[request] = (command, task)
            task.add_done_callback(lambda _: self._waits.pop(request, None))

    async def _loss_reason(self) -> str:
        """Why the group is re-forming (the controller's words, naming the lost worker): now
        if a FormGroup has come, else once one comes (at most LOSS_REASON_WAIT s), else the
        last loss if it is recent; "" when there is none."""
        superseded = self.membership.superseded
        if not superseded.is_set():
            try:
                await asyncio.wait_for(superseded.wait(), LOSS_REASON_WAIT)
            except TimeoutError:
                pass
        return self.membership.loss_reason()

    # ---- collective groups ---------------------------------------------------------------

    async def _form(self, message: m.FormGroup) -> None:
        assert self._described is not None
        loop = asyncio.get_running_loop()
        config = self.config
        joins = [loop.run_in_executor(
            None, join_group, message.address, message.node_id, message.num_nodes,
            self._described.platform, self._described.devices, config.group_timeout,
            config.gloo_scheduling)]
        if message.companion_address:  # the colocated CPU devices' group, at the same time
            joins.append(loop.run_in_executor(
                None, join_group, message.companion_address, message.node_id,
                message.num_nodes, "cpu", self._described.devices, config.group_timeout,
                config.gloo_scheduling))
        joined = await asyncio.gather(*joins, return_exceptions=True)
        failed = next((j for j in joined if isinstance(j, BaseException)), None)
        if failed is not None:
            self.reply(message.request, error=errors.WorkerLost(
                f"joining collective group {message.generation} failed: {failed}"))
            return
        self._keep.extend(distributed for distributed, _ in joined)
        client = joined[0][1]
        self._next = (message.generation, client, joined[1][1] if len(joined) > 1 else None)
        self.reply(message.request, [d.id for d in client.local_devices()])

    async def _activate(self, mapping: dict[int, int]) -> None:
        if self._next is None:
            raise errors.InternalError("a DeviceMap came before any collective group was "
                                       "joined; this is a bug in isthmus.")
        generation, client, next_companions = self._next
        companions = None
        if next_companions is not None:
            by_id = {d.id: d for d in client.devices()}
            companions = companion_devices({g: by_id[j] for g, j in mapping.items()},
                                           next_companions, COMPANION_BASE)
        new = make_host(client, mapping, self.config.platform.simulate_flops,
                        self._compile_cache, companions)
        old, self.host = self.host, new
        if old is None and not self._settled:
            gctune.settle()  # jax and the first group are loaded: what this process keeps
            self._settled = True
        if old is not None:
            await old.settle_writes()  # host data still being placed lands in `old` first
            moved, calls = await asyncio.get_running_loop().run_in_executor(
                None, new.adopt, old, self.membership.pending_reason)
            await new.python.take_calls(calls, old.devices)
            logger.info("moved %s buffers into the new collective group (%s outputs of "
                        "colocated calls still running follow)", moved, len(calls))
            # Waits still pending are on computations the old group never finished: ask
            # them again here, where such buffers now hold their error.
            for command, task in list(self._waits.values()):
                task.cancel()
                self.applier.apply(command)
        self.membership.handle(GroupActive(generation))


async def run_worker(config: WorkerConfig) -> int:
    """Runs a worker until it stops; stop signals end it gracefully."""
    agent = WorkerAgent(config)
    watch_stop_signals(agent.stop_soon, agent.stop)
    return await agent.run()
