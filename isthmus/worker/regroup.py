"""Moving a host's buffers into the jaxlib client of a re-formed collective group.

When the group re-forms, each worker builds a new client and its buffers move across through
host memory. What was still being computed when the group broke is sorted here: work that
waits for a peer that is gone never finishes and becomes an error at once; other work is
given time to finish. The outputs of colocated Python calls still running are not waited
for: the new host takes their placeholders over, and a call stores its outputs there, moved
with `onto`, when it ends (`python_calls.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import numpy as np

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray, JaxlibDevice
from isthmus.ids import BufferId
from isthmus.worker.buffers import BufferStore
from isthmus.worker.colocated import Pending
from isthmus.worker.slots import Failed, HostArray, Slot, settle_quietly


def onto(value: Slot, device_ids: Mapping[JaxlibDevice, int],
         new_devices: Mapping[int, JaxlibDevice]) -> Slot:
    """A computed single-device array copied from an old client's device (global ids in
    `device_ids`) onto the device of the same global id in `new_devices` (through host
    memory: two clients share nothing). Host arrays and errors stay as they are. Blocking."""
    import jax
    from jax.sharding import SingleDeviceSharding

    if isinstance(value, (Failed, HostArray)):
        return value
    return jax.device_put(np.asarray(value), SingleDeviceSharding(
        new_devices[device_ids[next(iter(value.devices()))]],
        memory_kind=value.sharding.memory_kind))


def adopt(old: BufferStore, old_devices: Mapping[int, JaxlibDevice], new: BufferStore,
          new_devices: Mapping[int, JaxlibDevice], reason: str = "", wait: float = 30.0
          ) -> tuple[int, dict[BufferId, Pending]]:
    """Moves every buffer of `old` into `new` (`move_buffers`) and empties `old`, but for the
    placeholders of colocated calls still running, which it returns (for
    `python.take_calls`, on the event loop) with how many buffers moved. Blocking."""
    slots, spans = old.take_all()
    calls = {b: v for b, v in slots.items() if isinstance(v, Pending)}
    for buffer_id in calls:
        del slots[buffer_id]
    into: dict[BufferId, Slot] = {}
    moved = move_buffers(slots, spans, old_devices, new_devices, into, reason, wait)
    new.adopt(into)
    return moved, calls


def move_buffers(buffers: Mapping[BufferId, Slot], spans: Mapping[BufferId, frozenset[int]],
                 old_devices: Mapping[int, JaxlibDevice], new_devices: Mapping[int, JaxlibDevice],
                 into: MutableMapping[BufferId, Slot], reason: str = "",
                 wait: float = 30.0) -> int:
    """Moves a host's `buffers` (on `old_devices`, by global device id) onto `new_devices`, the
    devices of a new collective group's client, storing each in `into` as it is done.

    `spans` names, for a program output, the devices of the program that computes it.
    `buffers` holds no colocated call's placeholder (`Pending`): the caller takes those.
    Blocking; run it in a thread. A buffer still being computed by a program over a
    device that is not in the new group waits for a lost peer and never finishes: it
    becomes an error buffer at once, with `reason` (why the group re-formed). Any other
    buffer not computed within `wait` seconds becomes an error too. Returns how many
    moved.
    """
    import threading
    import time

    moved = 0
    device_ids = {d: g for g, d in old_devices.items()}
    deadline = time.monotonic() + wait
    items = list(buffers.items())
    # A device whose queue holds a computation stuck on a lost peer runs nothing after
    # it: everything unfinished there is stuck too.
    stuck_devices = set()
    for buffer_id, value in items:
        span = spans.get(buffer_id)
        if (span is not None and not span <= new_devices.keys()
                and not isinstance(value, (Failed, HostArray)) and not value.is_deleted()
                and not value.is_ready()):
            stuck_devices.update(value.devices())
    for buffer_id, value in items:
        if isinstance(value, (Failed, HostArray)):
            into[buffer_id] = value
            continue
        if value.is_deleted():
            into[buffer_id] = value  # donated to a later program: nothing to move
            continue
        assert not isinstance(value, Pending), "the caller takes colocated calls' outputs"
        try:
            if stuck_devices and not value.is_ready() and (
                    not stuck_devices.isdisjoint(value.devices())):
                into[buffer_id] = Failed(errors.WorkerLost(
                    f"the computation of this array spanned a worker that was lost "
                    f"({reason or 'a peer left the collective group'}); recreate it, "
                    "or continue on the slices that are up."))
                continue
            if value.is_ready() and _lost_a_peer(value):
                into[buffer_id] = Failed(errors.WorkerLost(
                    f"the computation of this array spanned a worker that was lost "
                    f"({reason or 'a peer left the collective group'}); recreate it, "
                    "or continue on the slices that are up."))
                continue
            if not value.is_ready():
                # Wait for it in a thread that may be abandoned, up to one deadline for
                # all buffers.
                waiter = threading.Thread(target=settle_quietly, args=(value,), daemon=True)
                waiter.start()
                waiter.join(max(0.0, deadline - time.monotonic()))
                if not value.is_ready():
                    raise TimeoutError("still being computed")
            into[buffer_id] = onto(value, device_ids, new_devices)
            moved += 1
        except Exception as e:  # noqa: BLE001 - includes the timeout
            into[buffer_id] = Failed(errors.WorkerLost(
                f"buffer {buffer_id} could not be moved into the re-formed collective "
                f"group ({type(e).__name__}: {e}); recreate the array."))
    return moved


def _lost_a_peer(value: JaxArray) -> bool:
    """A computed buffer whose computation failed because its collective lost a peer."""
    try:
        value.block_until_ready()
    except Exception as e:  # noqa: BLE001 - its stored error
        return errors.is_peer_failure(str(e))
    return False
