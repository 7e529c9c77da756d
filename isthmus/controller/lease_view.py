"""A lease's part of the fleet: what a session of a shared service sees and may use.

`FleetView` is the `Fleet` a session of a lease holds: it lists the devices of the lease's
slices only, finds no other device (NOT_FOUND, as for any handle of another tenant), and
reports a slice that a higher priority reclaimed as unavailable (DATA_LOSS) until it comes
back. Channels and multicasts go to the whole fleet's, for the lease's workers only, and flow
control waits only for their backlogs. It implements each member of `Fleet` itself: nothing
reaches the whole fleet unless a method here passes it on, so a member added to `Fleet`
needs a lease's answer here before sessions can use it.

The devices a session lists are fixed when it opens (the client reads them once), as the
lease's slices were then, reclaimed ones included. Slice indices are renumbered for the
client (`slice_label`): a lease of slices 3 and 5 shows slices 0 and 1, as a job of its own
would see them, so that `jax.make_mesh`, hybrid meshes and pathwaysutils' elastic Manager
work unchanged; device ids stay the fleet's.
"""

from __future__ import annotations

from collections.abc import Iterable

from isthmus import errors
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.controller.leases import Lease
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.transport.base import WorkerChannel
from isthmus.transport.commands import Command
from isthmus.transport.flow import ScopedFlow


class FleetView:
    """The fleet as the sessions of one lease see it (a `Fleet`)."""

    def __init__(self, fleet: WholeFleet, lease: Lease) -> None:
        self._fleet = fleet
        self.lease = lease
        self.slices = lease.seen_slices  # fixed: the client lists these devices for good
        labels = {s: i for i, s in enumerate(self.slices)}
        self._labels = labels
        self.devices = tuple(d for d in fleet.devices if d.slice_index in labels)
        self.companions = tuple(d for d in fleet.companions if d.slice_index in labels)
        self._by_id = {d.id: d for d in self.devices + self.companions}
        self._workers = frozenset(d.worker for d in self.devices)
        # Only the lease's own workers' backlogs hold its sessions back.
        self.flow = ScopedFlow(fleet.flow, self._workers)

    @property
    def all_devices(self) -> tuple[Device, ...]:
        return self.devices + self.companions

    def slice_label(self, device: Device) -> int:
        """The slice index the client sees for `device` (its slice's place in the lease)."""
        return self._labels[device.slice_index]

    def device(self, device_id: int) -> Device:
        device = self._by_id.get(DeviceId(device_id))
        if device is None:
            raise errors.UnknownHandle(
                f"device id {device_id} is not one of lease {self.lease.id}'s devices (ids "
                f"{sorted(self._by_id)[:16]}); use a device from jax.devices().")
        return device

    def devices_of(self, device_ids: Iterable[int]) -> tuple[Device, ...]:
        return tuple(self.device(d) for d in device_ids)

    def unavailable(self, devices: Iterable[Device]) -> errors.IsthmusError | None:
        """Why work on `devices` cannot run now: a slice reclaimed from the lease, or down."""
        devices = tuple(devices)
        reclaimed = self.lease.reclaimed
        if reclaimed:
            for device in devices:
                if device.slice_index in reclaimed:
                    return reclaimed_error(self.lease, device.slice_index)
        return self._fleet.unavailable(devices)

    def slice_error_of(self, worker: WorkerId) -> errors.IsthmusError:
        return self._fleet.slice_error_of(self._own(worker))

    def channel(self, worker: WorkerId) -> WorkerChannel:
        return self._fleet.channel(self._own(worker))

    def multicast(self, workers: tuple[WorkerId, ...], command: Command) -> None:
        if not self._workers.issuperset(workers):
            for worker in workers:
                self._own(worker)
        self._fleet.multicast(workers, command)

    def _own(self, worker: WorkerId) -> WorkerId:
        """`worker`, which must serve one of the lease's slices (its sessions name workers
        only through the lease's devices: another is a bug, and reaches no one)."""
        if worker not in self._workers:
            raise errors.InternalError(
                f"a session of lease {self.lease.id} addressed worker {worker}, which serves "
                "none of the lease's slices; this is a bug in isthmus: please report it.")
        return worker


def reclaimed_error(lease: Lease, slice_index: SliceId) -> errors.SliceReclaimed:
    return errors.SliceReclaimed(
        f"slice {slice_index} of elastic lease {lease.id} was reclaimed by a higher-priority "
        "job; its arrays there are gone. Go on with the other slices (pathwaysutils' elastic "
        "Manager does); the slice comes back when it is free again.")
