"""A lease's part of the fleet: what a session of a shared service sees and may use.

`FleetView` stands where a session would hold the `Fleet`: it lists the devices of the
lease's slices only, finds no other device (NOT_FOUND, as for any handle of another tenant),
and reports a slice that a higher priority reclaimed as unavailable (DATA_LOSS) until it
comes back. Everything else (channels, dispatch, flow control) is the fleet's own.

The devices a session lists are fixed when it opens (the client reads them once), as the
lease's slices were then, reclaimed ones included. Slice indices are renumbered for the
client (`slice_label`): a lease of slices 3 and 5 shows slices 0 and 1, as a job of its own
would see them, so that `jax.make_mesh`, hybrid meshes and pathwaysutils' elastic Manager
work unchanged; device ids stay the fleet's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from isthmus import errors
from isthmus.controller.fleet import Device, Fleet
from isthmus.controller.leases import Lease
from isthmus.ids import DeviceId, SliceId
from isthmus.transport.flow import ScopedFlow


class FleetView:
    """The fleet as the sessions of one lease see it."""

    def __init__(self, fleet: Fleet, lease: Lease) -> None:
        self._fleet = fleet
        self.lease = lease
        self.slices = lease.seen_slices  # fixed: the client lists these devices for good
        labels = {s: i for i, s in enumerate(self.slices)}
        self._labels = labels
        self.devices = tuple(d for d in fleet.devices if d.slice_index in labels)
        self.companions = tuple(d for d in fleet.companions if d.slice_index in labels)
        self._by_id = {d.id: d for d in self.devices + self.companions}
        # Only the lease's own workers' backlogs hold its sessions back.
        self.flow = ScopedFlow(fleet.flow, frozenset(d.worker for d in self.devices))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fleet, name)

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

    @property
    def down_slices(self) -> dict[SliceId, errors.IsthmusError]:
        down = {s: e for s, e in self._fleet.down_slices.items() if s in self._labels}
        for s in self.lease.reclaimed:
            down.setdefault(s, reclaimed_error(self.lease, s))
        return down


def reclaimed_error(lease: Lease, slice_index: SliceId) -> errors.SliceReclaimed:
    return errors.SliceReclaimed(
        f"slice {slice_index} of elastic lease {lease.id} was reclaimed by a higher-priority "
        "job; its arrays there are gone. Go on with the other slices (pathwaysutils' elastic "
        "Manager does); the slice comes back when it is free again.")
