"""The fleet as the controller sees it: devices, the hosts that own them, and slices.

Global device ids are what the client sees; they are fixed by position: slice, host within
the slice, device within the host. A device belongs to a host *slot* (`Device.worker`), which
keeps its id when the worker process serving it is replaced. `local_id` is the device's
index on its host.

A slice is usable while every host slot of it has a live worker in the current collective
group; otherwise `unavailable` names the reason (a DATA_LOSS error naming worker and slice).

`Fleet` is what a session may ask of the fleet it works on: the whole fleet (`WholeFleet`,
which the controller and the fleet manager hold) or a lease's part of it
(`lease_view.FleetView`), which answers for the lease's devices and workers only.

On an accelerator fleet each accelerator has a *colocated CPU device* on its host (jax's
`colocated_python` runs there): a `Device` with `companion_of` set, id `COMPANION_BASE` plus
its accelerator's, and the accelerator's `colocation_id`. They are in `all_devices` and found
by id, but not in `devices` (what `jax.devices()` lists and device assignments draw from).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import NoReturn, Protocol, TypeVar

from isthmus import errors
from isthmus.ids import COMPANION_BASE, DeviceId, SliceId, WorkerId
from isthmus.transport.base import Commands, WorkerChannel
from isthmus.transport.commands import Command, Request
from isthmus.transport.flow import FlowGate

_T = TypeVar("_T")

MAX_FLUSH_WAIT = 0.001  # seconds shared commands may wait for more of their kind

# A channel's `deliver`: hands it commands (`more`: another of the caller's follows).
Deliver = Callable[[Commands, bool], None]

# Memory kinds every jaxlib CPU device offers, default first.
CPU_MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or CPU device) of the fleet."""

    id: DeviceId  # global id, stable for a given fleet
    worker: WorkerId  # the host slot that owns it
    local_id: int  # its index on that host
    platform: str  # "cpu", "cuda"
    kind: str  # jaxlib device_kind, e.g. "cpu"
    slice_index: SliceId
    host_index: int  # index of the worker within its slice
    memory_kinds: tuple[str, ...] = CPU_MEMORY_KINDS  # default first
    # A colocated CPU device: the accelerator it stands beside (None: not one).
    companion_of: DeviceId | None = None
    # What the backend says of it beyond the above, passed to the client as device
    # attributes: a TPU's `coords` and `core_on_chip`, which jax's meshes are built from.
    attributes: tuple[tuple[str, int | tuple[int, ...]], ...] = ()

    def __repr__(self) -> str:
        return f"Device({self.id}, slice={self.slice_index}, host={self.host_index})"

    @property
    def colocation_id(self) -> int:
        """Equal for an accelerator and its colocated CPU device (jax matches them by it)."""
        return self.id if self.companion_of is None else self.companion_of

    def companion(self) -> Device:
        """This accelerator's colocated CPU device."""
        return Device(DeviceId(COMPANION_BASE + self.id), self.worker, self.local_id, "cpu",
                      "cpu", self.slice_index, self.host_index, CPU_MEMORY_KINDS, self.id)


class Flow(Protocol):
    """Flow control as a session's clients see it: closed while a worker they use has too
    much outstanding work (`transport.flow.FlowGate`, or a lease's `ScopedFlow`)."""

    @property
    def is_open(self) -> bool: ...

    async def wait(self) -> None: ...


class Fleet(Protocol):
    """What a session may ask of the fleet it works on: its devices, the channels to their
    workers, and whether work on them can run now."""

    @property
    def devices(self) -> tuple[Device, ...]:
        """The accelerators (what `jax.devices()` lists and device assignments draw from)."""
        ...

    @property
    def all_devices(self) -> tuple[Device, ...]:
        """The accelerators and their colocated CPU devices."""
        ...

    @property
    def flow(self) -> Flow: ...

    def device(self, device_id: int) -> Device:
        """The device with this id (an error the client sees when there is none)."""
        ...

    def devices_of(self, device_ids: Iterable[int]) -> tuple[Device, ...]: ...

    def slice_label(self, device: Device) -> int:
        """The slice index the client sees for `device`."""
        ...

    def unavailable(self, devices: Iterable[Device]) -> errors.IsthmusError | None:
        """Why work on `devices` cannot run now, or None when it can."""
        ...

    def slice_error_of(self, worker: WorkerId) -> errors.IsthmusError:
        """Why `worker` has no live channel."""
        ...

    def channel(self, worker: WorkerId) -> WorkerChannel: ...

    def multicast(self, workers: tuple[WorkerId, ...], command: Command) -> None: ...


class WholeFleet:
    """Devices, live worker channels, and why some slices are down."""

    def __init__(self, devices: Sequence[Device], workers: dict[WorkerId, WorkerChannel]
                 ) -> None:
        self.devices: tuple[Device, ...] = ()  # the accelerators (or a CPU fleet's devices)
        self.companions: tuple[Device, ...] = ()  # their colocated CPU devices, if any
        self._by_id: dict[DeviceId, Device] = {}
        self._workers = dict(workers)
        self.generation = 0  # bumped whenever the collective group re-forms
        # Bumped whenever a host slot's channel changes (attach, detach, membership): what
        # was sent to the channels of an earlier epoch may not be on the current ones.
        self.epoch = 0
        # Slots whose workers are in the current collective group (None: every worker, as in
        # the embedded backend). A registered worker gets work only once it is a member.
        self._members: set[WorkerId] | None = None
        # One tuple object per distinct set of workers (`worker_set`), so that commands for
        # the same workers can be recognised by identity and routes stay few.
        self._worker_sets: dict[tuple[WorkerId, ...], tuple[WorkerId, ...]] = {}
        # worker set id -> (that set, its channels' `deliver`); cleared on any change.
        self._routes: dict[int, tuple[tuple[WorkerId, ...], list[Deliver]]] = {}
        self._down: dict[SliceId, errors.IsthmusError] = {}
        self.flow = FlowGate()  # closed while some worker has too much outstanding work
        # Commands for several workers, this event-loop turn, in order. Consecutive ones for
        # the same workers share one `Commands`; any single-worker command flushes first.
        self._outbox: list[tuple[tuple[WorkerId, ...], Commands]] = []
        self._flushed_at = 0.0  # loop time the last shared commands went out
        self._flush_cost = 0.0  # seconds handing them out took
        self.add_devices(devices)

    @property
    def workers(self) -> dict[WorkerId, WorkerChannel]:
        """Live channels by host slot (read-only: change them with `attach`/`detach`)."""
        return self._workers

    def attach(self, worker: WorkerId, channel: WorkerChannel) -> None:
        self.flush()
        self._workers[worker] = channel
        self._changed()

    def detach(self, worker: WorkerId) -> None:
        self.flush()
        self._workers.pop(worker, None)
        self._changed()

    @property
    def members(self) -> set[WorkerId] | None:
        return self._members

    @members.setter
    def members(self, members: set[WorkerId] | None) -> None:
        self.flush()
        self._members = members
        self._changed()

    def _changed(self) -> None:
        self._routes.clear()
        self.epoch += 1

    def add_devices(self, devices: Sequence[Device]) -> None:
        known = dict(self._by_id)
        known.update({d.id: d for d in devices})
        ordered = sorted(known.values(), key=lambda d: d.id)
        self.devices = tuple(d for d in ordered if d.companion_of is None)
        self.companions = tuple(d for d in ordered if d.companion_of is not None)
        self._by_id = known

    @property
    def all_devices(self) -> tuple[Device, ...]:
        return self.devices + self.companions

    def device(self, device_id: int) -> Device:
        device = self._by_id.get(DeviceId(device_id))
        if device is None:
            raise errors.InvalidRequest(
                f"device id {device_id} is not part of this fleet (known ids: "
                f"{_ids(self.devices)}{_companion_ids(self.companions)}); use a device from "
                "jax.devices().")
        return device

    def devices_of(self, device_ids: Iterable[int]) -> tuple[Device, ...]:
        return tuple(self.device(d) for d in device_ids)

    def slice_label(self, device: Device) -> int:
        return device.slice_index

    def channel(self, worker: WorkerId) -> WorkerChannel:
        """The channel to one worker (a `LostChannel` when it has none)."""
        if self._outbox:
            self.flush(more=True)
        return self._channel(worker)

    def _channel(self, worker: WorkerId) -> WorkerChannel:
        channel = self._workers.get(worker)
        if channel is None or (self._members is not None and worker not in self._members):
            return LostChannel(self.slice_error_of(worker))
        return channel

    def worker_set(self, workers: Iterable[WorkerId]) -> tuple[WorkerId, ...]:
        """The canonical tuple of these workers (first-seen order, each once): the same
        object for the same workers, as `multicast` wants."""
        key = tuple(dict.fromkeys(workers))
        return self._worker_sets.setdefault(key, key)

    def multicast(self, workers: tuple[WorkerId, ...], command: Command) -> None:
        """Sends one fire-and-forget command to several workers.

        The cost per worker is paid once per hand-out, not once per command: consecutive
        commands for the same workers (`workers` from `worker_set`, so the same workers are
        the same object) share one record. Commands go out at the end of the event-loop turn;
        when the last hand-out was expensive (a large fleet), the next waits as long as that
        one took, so that at most about half of the controller's time goes to fanning out
        and a burst of programs shares one hand-out. A single-worker command, and every
        request (`channel()`), hands out what is waiting first, so order is kept and a
        waiting client is not delayed.
        """
        outbox = self._outbox
        if outbox and outbox[-1][0] is workers:
            outbox[-1][1].items.append(command)
            return
        if len(workers) == 1 and not outbox:
            self._channel(workers[0]).send(command)
            return
        if not outbox:
            loop = asyncio.get_running_loop()
            due = self._flushed_at + self._flush_cost
            if due > loop.time():
                loop.call_at(due, self.flush)
            else:
                loop.call_soon(self.flush)
        outbox.append((workers, Commands([command])))

    def flush(self, more: bool = False) -> None:
        """Hands the waiting shared commands to their workers (`more`: a command of the
        caller's follows, which they may wait for: one send to its worker, not two)."""
        if not self._outbox:
            return
        started = time.perf_counter()
        outbox, self._outbox = self._outbox, []
        for workers, commands in outbox:
            route = self._routes.get(id(workers))
            if route is None or route[0] is not workers:
                route = (workers, [self._channel(w).deliver for w in workers])
                self._routes[id(workers)] = route
            for deliver in route[1]:
                deliver(commands, more)
        self._flush_cost = min(time.perf_counter() - started, MAX_FLUSH_WAIT)
        self._flushed_at = asyncio.get_running_loop().time()

    # ---- health --------------------------------------------------------------------------

    def mark_down(self, slice_index: SliceId, error: errors.IsthmusError) -> None:
        self._down.setdefault(slice_index, error)

    def mark_up(self, slice_index: SliceId) -> None:
        self._down.pop(slice_index, None)

    def slice_error(self, slice_index: SliceId) -> errors.IsthmusError | None:
        return self._down.get(slice_index)

    def slice_error_of(self, worker: WorkerId) -> errors.IsthmusError:
        for device in self.devices:
            if device.worker == worker and device.slice_index in self._down:
                return self._down[device.slice_index]
        return errors.WorkerLost(
            f"host slot {worker} has no live worker; start `isthmus worker` for its slice.")

    def unavailable(self, devices: Iterable[Device]) -> errors.IsthmusError | None:
        """Why work on `devices` cannot run now, or None when it can."""
        if not self._down:
            return None
        for device in devices:
            error = self._down.get(device.slice_index)
            if error is not None:
                return error
        return None

    @property
    def down_slices(self) -> dict[SliceId, errors.IsthmusError]:
        return dict(self._down)

    @property
    def platform(self) -> str:
        return self.devices[0].platform if self.devices else "cpu"


class LostChannel:
    """Stands for a host slot with no live worker: requests fail with the slot's loss, and
    fire-and-forget commands are dropped (the controller has already poisoned what they
    touch)."""

    local = True  # `WorkerChannel.local`: nothing to read ahead from a lost slot

    def __init__(self, error: errors.IsthmusError) -> None:
        self.error = error

    def send(self, command: Command) -> None:
        pass

    def ask(self, request: Request[_T]) -> Awaitable[_T]:
        return self._fail()

    async def _fail(self) -> NoReturn:
        raise self.error

    def deliver(self, commands: Commands, more: bool = False) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


def _ids(devices: Sequence[Device]) -> str:
    if not devices:
        return "none"
    ids = [d.id for d in devices]
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(str(i) for i in ids[:16]) + ("..." if len(ids) > 16 else "")


def _companion_ids(companions: Sequence[Device]) -> str:
    return f", and their colocated CPU devices {_ids(companions)}" if companions else ""
