"""The fleet as the controller sees it: devices, the workers that own them, and slices.

Global device ids are what the client sees. Each device belongs to one worker (a host) and
one slice; `local_id` is the device's id in that worker's own jaxlib client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from isthmus import errors
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.transport.base import WorkerChannel

# Memory kinds every jaxlib CPU device offers, default first.
CPU_MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or CPU device) of the fleet."""

    id: DeviceId  # global id, stable for a given fleet
    worker: WorkerId  # the host that owns it
    local_id: int  # its id in the worker's jaxlib client
    platform: str  # "cpu", "cuda"
    kind: str  # jaxlib device_kind, e.g. "cpu"
    slice_index: SliceId
    host_index: int  # index of the worker within its slice
    memory_kinds: tuple[str, ...] = CPU_MEMORY_KINDS  # default first

    def __repr__(self) -> str:
        return f"Device({self.id}, slice={self.slice_index}, host={self.host_index})"


class Fleet:
    """Devices and worker channels; the resource manager's view of the hardware."""

    def __init__(self, devices: Sequence[Device], workers: dict[WorkerId, WorkerChannel]
                 ) -> None:
        self.devices: tuple[Device, ...] = tuple(sorted(devices, key=lambda d: d.id))
        self._by_id = {d.id: d for d in self.devices}
        self.workers = dict(workers)

    def device(self, device_id: int) -> Device:
        device = self._by_id.get(DeviceId(device_id))
        if device is None:
            raise errors.InvalidRequest(
                f"device id {device_id} is not part of this fleet (known ids: "
                f"{_ids(self.devices)}); use a device from jax.devices().")
        return device

    def devices_of(self, device_ids: Iterable[int]) -> tuple[Device, ...]:
        return tuple(self.device(d) for d in device_ids)

    def channel(self, worker: WorkerId) -> WorkerChannel:
        return self.workers[worker]

    @property
    def platform(self) -> str:
        return self.devices[0].platform if self.devices else "cpu"


def _ids(devices: Sequence[Device]) -> str:
    if not devices:
        return "none"
    ids = [d.id for d in devices]
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(str(i) for i in ids[:16]) + ("..." if len(ids) > 16 else "")
