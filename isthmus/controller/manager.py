"""The resource manager: worker registration, host slots, health, and the collective group.

Each slice has `hosts_per_slice` host slots; a registering worker takes the first free slot
of the slice it names (a restarted worker therefore takes back the slot of the one it
replaces, and its devices keep their global ids). Global device id =
(slice * hosts_per_slice + host) * devices_per_host + local index.

All live workers form one collective group (jax's distributed runtime: a coordination
service in this process, gloo collectives between the workers), so a program may span any
devices. The service is *recoverable*: a member that dies does not take the others down. A
lost worker marks its slice down: its arrays are poisoned with DATA_LOSS and work touching
the slice fails, while other slices go on. Whenever membership changes the group re-forms
as a new *generation*: every worker builds a fresh jaxlib client on a new coordination
service and moves its buffers into it (computations stuck on the lost peer are abandoned),
and executables are compiled again on first use. A slice comes back when all its host slots
are members again.

A worker whose predecessor in its slot died of a fatal signal says so when it registers
(`Register.crash`, from the slot's crash records); `on_crash` then refuses the program that
was being dispatched. Reports name executables of one controller process (`incarnation`,
sent in the Welcome and kept in the records): a report from another one is only logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import TypedDict

from isthmus import errors
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.controller.formation import GroupFormation
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.logs import event
from isthmus.transport import messages as m
from isthmus.transport.frames import Parts
from isthmus.transport.remote import RemoteWorker

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSpec:
    """The shape of a fleet."""

    # One slice of two hosts: a plain JAX program (jax.make_mesh refuses several slices)
    # still crosses processes in its collectives.
    slices: int = 1
    hosts_per_slice: int = 2
    devices_per_host: int = 4
    platform: str = "cpu"  # "cpu", "cuda", or "auto": the first worker to register decides


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerConfig:
    heartbeat_interval: float = 0.5  # seconds between a worker's heartbeats
    # Silence (no pulse, no message) after which a worker counts as lost. Pulses come from a
    # thread of the worker's own, so a busy worker is never silent; a stopped or dead one is.
    heartbeat_timeout: float = 4.0
    # A worker that holds commands it applies none of, while its heartbeats say it waits for
    # nothing, for this long, has a stopped command loop (a bug): it counts as lost.
    stall_timeout: float = 5.0
    formation_timeout: float = 60.0  # seconds to build a collective group
    advertise_host: str = "127.0.0.1"  # where workers reach this process
    # A directory for bulk data with workers on this machine (None: every byte streams).
    shared_dir: str | None = None
    # A fleet on one machine without TCP: its collective groups' coordination services on
    # Unix sockets in this directory (None: TCP at advertise_host).
    unix_dir: str | None = None


class WorkerStatus(TypedDict):
    """One worker's entry in the fleet's status (`isthmus status`, the live page)."""

    host: str
    pid: int
    member: bool  # in the current collective group
    backlog: int  # commands sent and not yet applied
    queued: int  # messages it has read and not yet applied (its last report)
    applying: str  # what it was applying then ("": nothing)
    log: str  # the file its output goes to ("": not a file)
    shared_memory: bool  # puts reach it through the shared directory


class FleetManager:
    """Registers workers into host slots and keeps the collective group formed (by its part
    `formation`, a `GroupFormation`)."""

    def __init__(self, spec: FleetSpec, fleet: WholeFleet, config: ManagerConfig | None = None,
                 on_slice_down: Callable[[SliceId, errors.IsthmusError], None] | None = None,
                 on_generation: Callable[[int], None] | None = None,
                 on_crash: Callable[[m.CrashReport, str], None] | None = None,
                 last_program: Callable[[WorkerId], str | None] | None = None) -> None:
        """`on_crash(report, worker)`: a worker process of this controller died of a fatal
        signal; `last_program(slot)`: the name of the last program given to a slot's
        worker, for the error when it is lost."""
        self.spec = spec
        self.fleet = fleet
        self.config = config or ManagerConfig()
        self._on_slice_down = on_slice_down or (lambda s, e: None)
        self._on_crash = on_crash or (lambda r, w: None)
        self._last_program = last_program or (lambda w: None)
        self.incarnation = secrets.randbits(63) | 1  # this controller process (never 0)
        self._tokens: dict[str, RemoteWorker] = {}  # live memberships by pulse token
        self._retiring: dict[WorkerId, str] = {}  # workers replaced on purpose, and why
        self.lost_count = 0  # workers lost since start (for the metrics)
        fleet.members = set()
        self.formation = GroupFormation(spec, fleet, self.config, self,
                                        on_generation or (lambda g: None))
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        # The first worker to register describes the devices (platform, kind, memory
        # kinds); until then the fleet's devices carry the spec's platform and CPU kinds.
        self._model: m.Register | None = None
        for slice_index in range(spec.slices):
            self._ensure_slice(SliceId(slice_index))

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._monitor()),
                       loop.create_task(self.formation.run())]

    async def stop(self, grace: float = 3.0) -> None:
        """Tells the workers to shut down and waits up to `grace` seconds for them to leave:
        the group's coordination services live in this process, and a member still in the
        group when they go is aborted by jaxlib (a hand-started worker's supervisor would
        take that for a crash and start it again)."""
        self._stopping = True
        for channel in list(self.fleet.workers.values()):
            if isinstance(channel, RemoteWorker):
                channel.send_now(m.Shutdown("the controller is stopping"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
                isinstance(c, RemoteWorker) for c in self.fleet.workers.values()):
            await asyncio.sleep(0.02)

    # ---- slots and devices ---------------------------------------------------------------

    def slot(self, slice_index: int, host: int) -> WorkerId:
        return WorkerId(slice_index * self.spec.hosts_per_slice + host)

    def _ensure_slice(self, slice_index: SliceId) -> None:
        """Adds the devices of a slice the fleet does not know yet (down until complete)."""
        if any(d.slice_index == slice_index for d in self.fleet.devices):
            return
        spec = self.spec
        self.fleet.mark_down(slice_index, errors.WorkerLost(
            f"slice {slice_index} has not got all its {spec.hosts_per_slice} hosts yet; "
            f"start its workers (`isthmus worker --slice {slice_index}`)."))
        devices = []
        for host in range(spec.hosts_per_slice):
            slot = self.slot(slice_index, host)
            for local in range(spec.devices_per_host):
                devices.append(Device(
                    DeviceId(slot * spec.devices_per_host + local), slot, local,
                    "cpu" if spec.platform == "auto" else spec.platform, "cpu", slice_index,
                    host))
        self.fleet.add_devices(self._describe(devices))

    def _describe(self, devices: list[Device]) -> list[Device]:
        """The devices as the model worker describes them, with their colocated CPU devices
        when its accelerators have them."""
        model = self._model
        if model is None:
            return devices
        # A host's devices take the model's attributes by local index (one-host TPU fleets;
        # a slice of several TPU hosts, whose chips' coordinates differ: docs/tpu.md).
        attributes = [tuple((str(n), v if isinstance(v, int) else tuple(v)) for n, v in a)
                      for a in model.device_attributes]
        described = [dataclasses.replace(d, platform=model.platform, kind=model.device_kind,
                                         memory_kinds=tuple(model.memory_kinds),
                                         attributes=attributes[d.local_id]
                                         if d.local_id < len(attributes) else ())
                     for d in devices]
        if model.companions:
            described += [d.companion() for d in described]
        return described

    def slices(self) -> list[SliceId]:
        return sorted({d.slice_index for d in self.fleet.devices})

    def slot_devices(self, slot: WorkerId) -> list[Device]:
        return [d for d in self.fleet.devices if d.worker == slot]

    @property
    def members(self) -> dict[WorkerId, RemoteWorker]:
        """The slots of the current collective group (`GroupFormation.members`)."""
        return self.formation.members

    async def form(self) -> None:
        """Forms the collective group now (`GroupFormation.form`)."""
        await self.formation.form()

    async def wait_complete(self, timeout: float) -> None:
        """Waits until every slice of the spec is up (`GroupFormation.wait_complete`)."""
        await self.formation.wait_complete(timeout)

    # ---- registration --------------------------------------------------------------------

    def _check_devices(self, message: m.Register) -> None:
        """Refuses a worker whose devices differ from the fleet's (platform, kind, count)."""
        spec, model = self.spec, self._model
        platform = model.platform if model is not None else (
            None if spec.platform == "auto" else spec.platform)
        brings = f"{message.devices} {message.platform} devices ({message.device_kind})"
        if platform is not None and message.platform != platform:
            raise errors.InvalidRequest(
                f"the worker brings {brings}; this fleet serves {platform}. Start it with "
                f"--platform {platform}.")
        if model is not None and message.device_kind != model.device_kind:
            raise errors.InvalidRequest(
                f"the worker brings {brings}; this fleet's devices are {model.device_kind}: "
                "every host of a fleet must have the same kind of device.")
        if model is not None and message.companions != model.companions:
            raise errors.InvalidRequest(
                f"the worker brings {brings} {'with' if message.companions else 'without'} "
                "colocated CPU devices, unlike this fleet's first worker; run the same "
                "isthmus version and settings on every host.")
        if message.devices != spec.devices_per_host:
            how = (f"--devices {spec.devices_per_host}" if message.platform == "cpu" else
                   f"{spec.devices_per_host} GPUs (--gpus or CUDA_VISIBLE_DEVICES)")
            raise errors.InvalidRequest(
                f"the worker brings {brings}; this fleet has {spec.devices_per_host} per "
                f"host. Start it with {how}.")

    def register(self, message: m.Register, send: Callable[[bytes | Parts], None], peer: str,
                 close: Callable[[], None] = lambda: None) -> RemoteWorker:
        """Takes a worker into a free slot; raises RequestError when it cannot be."""
        spec = self.spec
        if message.version != m.PROTOCOL_VERSION:
            raise errors.VersionMismatch(
                f"the worker speaks fleet protocol {message.version}, the controller "
                f"{m.PROTOCOL_VERSION}; run the same isthmus version everywhere.")
        self._check_devices(message)
        if self._model is None:
            self._model = message
            self.fleet.add_devices(self._describe(list(self.fleet.devices)))
        slice_index = message.slice_index
        if slice_index < 0:
            slice_index = next((s for s in self.slices() if self._free_host(s) is not None),
                               len(self.slices()))
        self._ensure_slice(SliceId(slice_index))
        host = self._free_host(SliceId(slice_index))
        if host is None:
            raise errors.InvalidRequest(
                f"slice {slice_index} already has its {spec.hosts_per_slice} live hosts; "
                "start the worker for another slice.")
        slot = self.slot(slice_index, host)
        token = secrets.token_hex(8)
        channel = RemoteWorker(slot, message, send, peer, close, self.fleet.flow, token)
        self._tokens[token] = channel
        self.fleet.attach(slot, channel)
        logger.info("worker %s:%s joined as slice %s host %s", message.hostname, message.pid,
                    slice_index, host, extra=event("worker_joined", slice=slice_index, host=host,
                                                   pid=message.pid))
        if message.crash is not None:
            self._crash_reported(message, slice_index, host)
        self.formation.want(joined=True)
        return channel

    def _crash_reported(self, message: m.Register, slice_index: int, host: int) -> None:
        crash = message.crash
        assert crash is not None
        where = f"{message.hostname}:{crash.pid} (slice {slice_index}, host {host})"
        if crash.controller == self.incarnation:
            self._on_crash(crash, where)
        else:
            logger.warning("worker %s died of a fatal signal (%s) while serving another "
                           "controller process; see its log", where, crash.fatal,
                           extra=event("worker_crashed", worker=where))

    def welcome(self, channel: RemoteWorker) -> m.Welcome:
        device = self.slot_devices(channel.slot)[0]
        channel.name = (f"{channel.register.hostname}:{channel.register.pid} (slice "
                        f"{device.slice_index}, host {device.host_index})")
        return m.Welcome(channel.slot, device.slice_index, device.host_index,
                         self.config.heartbeat_interval, self._probe(channel), channel.token,
                         self.incarnation, channel.data_key)

    def alive(self, token: str) -> bytes:
        """A worker's pulse: what it should do (`messages.ALIVE_*`)."""
        if self._stopping:
            return m.ALIVE_STOP
        channel = self._tokens.get(token)
        if channel is None or channel.lost is not None:
            return m.ALIVE_DROPPED
        channel.last_seen = time.monotonic()
        return m.ALIVE_OK

    def _probe(self, channel: RemoteWorker) -> tuple[str, str] | None:
        """A file only a worker on this machine can read: its answer (SharedDir) lets bulk
        data to and from it go through the shared directory instead of the stream."""
        if self.config.shared_dir is None:
            return None
        token = secrets.token_hex(16)
        path = os.path.join(self.config.shared_dir, f"probe-{channel.slot}-{token[:8]}")
        try:
            with open(path, "w") as f:
                f.write(token)
        except OSError as e:
            logger.info("no shared-directory probe for worker %s: %s", channel.slot, e)
            return None
        channel.probe = (self.config.shared_dir, path)
        return path, token

    def _free_host(self, slice_index: SliceId) -> int | None:
        for host in range(self.spec.hosts_per_slice):
            if self.slot(slice_index, host) not in self.fleet.workers:
                return host
        return None

    # ---- loss ----------------------------------------------------------------------------

    def lost(self, channel: RemoteWorker, reason: str) -> None:
        """A worker disconnected or went silent."""
        self._tokens.pop(channel.token, None)
        if self.fleet.workers.get(channel.slot) is not channel:
            return
        retired = self._retiring.pop(channel.slot, None)
        if retired is not None:  # we replace it on purpose: no loss, no warning
            device = self.slot_devices(channel.slot)[0]
            logger.info("worker %s:%s (slice %s) retired: %s", channel.register.hostname,
                        channel.register.pid, device.slice_index, retired)
            self.fleet.detach(channel.slot)
            self.formation.leave(channel.slot)
            error = errors.WorkerLost(f"slice {device.slice_index}'s worker was retired: "
                                      f"{retired}.")
            channel.mark_lost(error)
            self.fleet.mark_down(device.slice_index, error)
            self._on_slice_down(device.slice_index, error)
            self.formation.want()
            return
        if self._stopping:  # we told it to go
            self.fleet.detach(channel.slot)
            channel.mark_lost(errors.SessionClosed("the server is shutting down."))
            return
        device = self.slot_devices(channel.slot)[0]
        register = channel.register
        program = self._last_program(channel.slot)
        if program is not None:
            reason += f"; the last program it was given was {program}"
        error = errors.WorkerLost(
            f"worker {register.hostname}:{register.pid} (slice {device.slice_index}, host "
            f"{device.host_index}) was lost: {reason}. Arrays on slice {device.slice_index} "
            "are gone; start a worker for that slice (`isthmus worker --slice "
            f"{device.slice_index}`) and recreate them, or continue on the other slices.")
        logger.warning("%s", error.message, extra=event(
            "worker_lost", slice=device.slice_index, host=device.host_index, pid=register.pid))
        self.lost_count += 1
        self.fleet.detach(channel.slot)
        self.formation.leave(channel.slot)
        channel.mark_lost(error)
        self.fleet.mark_down(device.slice_index, error)
        self._on_slice_down(device.slice_index, error)
        self.formation.want(loss=error.message)

    def retire(self, slice_index: SliceId, reason: str) -> None:
        """The workers of `slice_index` are about to end on purpose (`LocalLauncher.renew`):
        their loss is logged as a retirement, not a failure."""
        for host in range(self.spec.hosts_per_slice):
            self._retiring[self.slot(slice_index, host)] = reason

    async def _monitor(self) -> None:
        interval = self.config.heartbeat_interval
        woke = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now, slept = time.monotonic(), time.monotonic() - woke
            woke = now
            if slept > interval + 1.0:
                # This loop was held up: pulses that arrived meanwhile wait unread behind
                # us. Judge nobody on this round's evidence.
                logger.info("the controller was busy for %.1f s; liveness checks resume", slept)
                continue
            self.judge(now)

    def judge(self, now: float) -> None:
        """Declares lost the workers that went silent, and those whose command loop stopped
        (`RemoteWorker.stalled`)."""
        for channel in list(self.fleet.workers.values()):
            # A worker building its jaxlib client may be silent; formation has its own
            # deadline.
            if not isinstance(channel, RemoteWorker):
                continue
            if not channel.forming and (
                    now - channel.last_seen > self.config.heartbeat_timeout):
                self.lost(channel, f"no heartbeat for {self.config.heartbeat_timeout:g} s")
            elif channel.stalled(now) > self.config.stall_timeout:
                # Its command loop stopped (a bug): what waits on it would wait forever.
                # Lost, its work fails with DATA_LOSS and it registers afresh.
                where = f"; its log: {channel.register.log}" if channel.register.log else ""
                self.lost(channel, (
                    f"it holds {channel.queued} messages it applies none of while it "
                    f"waits for nothing, for {self.config.stall_timeout:g} s: its command "
                    f"loop has stopped, which is a bug in isthmus (please report it with "
                    f"the worker's log{where})"))

    def status(self) -> dict[str, WorkerStatus]:
        out: dict[str, WorkerStatus] = {}
        for slot, channel in self.fleet.workers.items():
            if isinstance(channel, RemoteWorker):
                out[str(slot)] = {"host": channel.register.hostname, "pid": channel.register.pid,
                                  "member": slot in self.members, "backlog": channel.backlog,
                                  "queued": channel.queued, "applying": channel.applying,
                                  "log": channel.register.log,
                                  "shared_memory": channel.shared_dir is not None}
        return out

