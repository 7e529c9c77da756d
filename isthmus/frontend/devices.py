"""Init, default device assignment and default layout requests."""

from __future__ import annotations

from collections.abc import Awaitable

from isthmus import errors
from isthmus.controller.fleet import Device
from isthmus.frontend.message import Message
from isthmus.frontend.session import FrontendSession

# Attributes every device carries (read by users and by pathwaysutils).
SLICE_INDEX = "slice_index"
HOST_INDEX = "host_index"
COLOCATION_ID = "colocation_id"


def memory_id(device_position: int, kind_position: int, kinds_per_device: int) -> int:
    return device_position * kinds_per_device + kind_position


def device_strings(device: Device) -> tuple[str, str]:
    """(debug_string, to_string) in jaxlib's style for the platform."""
    if device.platform == "cpu":
        return f"cpu:{device.id}", f"CpuDevice(id={device.id})"
    return f"{device.platform}:{device.id}", f"{device.kind}(id={device.id})"


def init(session: FrontendSession, request: Message, response: Message) -> None:
    out = response.init_response
    platform = session.platform
    out.session_id = session.id
    out.platform_name = platform["name"]
    out.platform_version = platform["version"]
    out.platform_id = platform["id"]
    out.process_index = 0
    out.runtime_type = platform["runtime_type"]
    fleet = session.fleet
    devices = fleet.all_devices
    # A lease's sessions see its slices numbered from 0 (`FleetView.slice_label`).
    slice_of = fleet.slice_label
    for position, device in enumerate(devices):
        kinds = device.memory_kinds
        ids = [memory_id(position, k, len(kinds)) for k in range(len(kinds))]
        debug, text = device_strings(device)
        d = out.all_devices.add(
            id=device.id, local_device_id=device.id, local_hardware_id=device.local_id,
            platform_name=device.platform, device_kind=device.kind, debug_string=debug,
            to_string=text, default_memory_id=ids[0])
        d.memory_ids.extend(ids)
        _attribute(d.attributes, SLICE_INDEX, slice_of(device))
        _attribute(d.attributes, HOST_INDEX, device.host_index)
        # jax's colocated_cpu_devices() matches a device with the CPU device of equal
        # colocation_id: on a CPU fleet each device is its own, on an accelerator fleet each
        # accelerator has one beside it (`WholeFleet.companions`).
        _attribute(d.attributes, COLOCATION_ID, device.colocation_id)
        for name, value in device.attributes:  # the backend's own (a TPU's coords)
            if isinstance(value, int):
                _attribute(d.attributes, name, value)
            else:
                d.attributes.attributes[name].int64_list_value.elements.extend(value)
        for k, (kind, mid) in enumerate(zip(kinds, ids)):
            label = f"{kind.upper()}_{mid}" if device.platform != "cpu" else (
                f"{'CPU_DEVICE' if k == 0 else kind.upper()}_{mid}")
            out.memories.add(id=mid, memory_space_kind=kind, kind_id=k, device_ids=[device.id],
                             debug_string=label, to_string=label)
    # Colocated CPU devices are addressable (arrays may live there) but not primary, so
    # jax.devices() lists the accelerators only, as on Pathways.
    out.primary_device_ids.extend(d.id for d in fleet.devices)
    out.addressable_device_ids.extend(d.id for d in devices)
    _attribute(out.client_attributes, "isthmus", 1)


def _attribute(attribute_map: Message, key: str, value: int) -> None:
    attribute_map.attributes[key].int64_value = int(value)


def default_device_assignment(session: FrontendSession, request: Message,
                              response: Message) -> None:
    body = request.get_default_device_assignment_request
    replicas, partitions = int(body.num_replicas), int(body.num_partitions)
    devices = session.fleet.devices
    if replicas < 1 or partitions < 1 or replicas * partitions > len(devices):
        raise errors.InvalidRequest(
            f"a device assignment of {replicas} replicas x {partitions} partitions needs "
            f"{replicas * partitions} devices; this fleet has {len(devices)}.")
    out = response.get_default_device_assignment_response.device_assignment
    out.replica_count = replicas
    out.computation_count = partitions
    for c in range(partitions):
        computation = out.computation_devices.add()
        computation.replica_device_ids.extend(
            devices[c * replicas + r].id for r in range(replicas))


def default_layout(session: FrontendSession, request: Message,
                   response: Message) -> Awaitable[None] | None:
    body = request.get_default_layout_request
    dtype = session.serdes.dtype(body.dtype)  # validates
    rank = len(body.dims)
    if rank > 64 or any(d < 0 for d in body.dims):
        raise errors.InvalidRequest(f"dims {list(body.dims)[:8]} are not a valid shape.")
    device = session.fleet.device(body.device_id)
    kind = body.memory_kind or ""
    if kind and kind not in device.memory_kinds:
        raise errors.InvalidRequest(
            f"memory kind {kind!r} is not one of device {device.id}'s "
            f"({', '.join(device.memory_kinds)}).")
    # The serving backend's own (a TPU's are tiled): row-major on CPU, asked once otherwise.
    layout = session.ctl.core.controller.default_layout(
        dtype, tuple(int(d) for d in body.dims), device, kind)
    out = response.get_default_layout_response
    if isinstance(layout, str):
        out.serialized_pjrt_layout = layout.encode()
        return None
    assert layout is not None  # asked of its host

    async def answer() -> None:
        out.serialized_pjrt_layout = (await layout).encode()

    return answer()
