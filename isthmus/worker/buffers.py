"""The shard buffers of one host (a part of `DeviceHost`), in explicit states.

A slot, under its controller-chosen `BufferId`, is in one of three states:

- *stored*: a jax array (or a simulated accelerator's stand-in for one), being computed or
  computed; `value` hands it out, or raises that it was deleted (donated);
- *host*: a `HostArray` (IFRT string arrays stay host objects);
- *failed*: a `Failed`, the error that prevented it; every use of it reports that error.

An id with no slot is *absent*: never made here, or freed. Beside the slots, `spans` keeps,
for a stored buffer that is still being computed by a program over other hosts, the devices
of that program and of the programs it came from: when the collective group re-forms without
one of them, the buffer never will be computed (`regroup.py`).

Invariants, checked by `validate_state` (tests call it after each step, as dask's worker
state machine does): every slot is in one of the three states; every span names a stored
buffer and is a non-empty frozenset of device ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray
from isthmus.ids import BufferId
from isthmus.worker.slots import Failed, HostArray, Slot


class BufferStore:
    """Slots and spans of one host's buffers (see the module's docstring)."""

    def __init__(self) -> None:
        self._slots: dict[BufferId, Slot] = {}
        self._spans: dict[BufferId, frozenset[int]] = {}

    # ---- reading -------------------------------------------------------------------------

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def ids(self) -> list[BufferId]:
        return list(self._slots)

    def slot(self, buffer_id: BufferId) -> Slot | None:
        """What the slot holds, whatever its state (None: absent)."""
        return self._slots.get(buffer_id)

    def value(self, buffer_id: BufferId) -> JaxArray | HostArray:
        """The stored array (or host array); raises the slot's error, or that it is absent
        or was deleted."""
        value = self._slots.get(buffer_id)
        if value is None:
            raise missing(buffer_id)
        if isinstance(value, Failed):
            raise value.error
        if value.is_deleted():
            raise errors.ArrayDeleted(
                "the array's data was deleted or donated to an earlier computation; "
                "keep a copy (or don't donate it) if you need it again.")
        return value

    def values(self, buffer_ids: Sequence[BufferId]) -> list[JaxArray | HostArray]:
        """`value` of each, in one call (a program's arguments)."""
        slots = self._slots
        out = []
        for buffer_id in buffer_ids:
            value = slots.get(buffer_id)
            if value is None or isinstance(value, Failed) or value.is_deleted():
                self.value(buffer_id)  # raises why
            out.append(value)
        return out

    def slots_of(self, refs: Sequence[int | Sequence[BufferId]]) -> list[Slot]:
        """What the slots of a one-device program's arguments hold, unchecked (`refs` as an
        Execute names them: a group base, the id of position 0, or the ids per position);
        raises why if one is absent. For `runs.run_one`, whose jaxlib call refuses what is
        not a live array."""
        slots = self._slots
        try:
            # An int is a group base, the id of its position 0 (no BufferId() call here).
            return [slots[ref if isinstance(ref, int) else ref[0]]  # type: ignore[index]
                    for ref in refs]
        except KeyError:
            for ref in refs:
                self.value(BufferId(ref) if isinstance(ref, int) else ref[0])  # raises
            raise

    def stored_arrays(self) -> list[JaxArray | HostArray]:
        """The stored and host arrays that still hold data."""
        return [v for v in self._slots.values()
                if not isinstance(v, Failed) and not v.is_deleted()]

    def computing(self, buffer_id: BufferId) -> bool:
        """The buffer is stored and still being computed (a finished one waits for no
        peer; nor does a donated one: the program it was donated to took over its wait)."""
        value = self._slots.get(buffer_id)
        return value is not None and not isinstance(value, (Failed, HostArray)) and (
            not value.is_deleted() and not value.is_ready())

    # ---- writing -------------------------------------------------------------------------

    def store(self, buffer_id: BufferId, value: Slot) -> None:
        """The slot holds `value`: an array (stored), a `HostArray` or a `Failed`."""
        self._slots[buffer_id] = value

    def store_all(self, buffer_ids: Sequence[BufferId], values: Sequence[Slot]) -> None:
        """`store` of each id with the value at its place (a program's outputs)."""
        self._slots.update(zip(buffer_ids, values))

    def fail(self, buffer_id: BufferId, error: errors.IsthmusError) -> None:
        self._slots[buffer_id] = Failed(error)
        self._spans.pop(buffer_id, None)

    def free(self, buffer_ids: Iterable[BufferId]) -> None:
        """Drops slots (absent ones are ignored). Dropping the reference frees the memory
        once no in-flight work uses it."""
        slots, spans = self._slots, self._spans
        for buffer_id in buffer_ids:
            slots.pop(buffer_id, None)
            if spans:
                spans.pop(buffer_id, None)

    def take_all(self) -> tuple[dict[BufferId, Slot], dict[BufferId, frozenset[int]]]:
        """Empties the store; its slots and spans (for a new collective group's store)."""
        slots, spans = self._slots, self._spans
        self._slots, self._spans = {}, {}
        return slots, spans

    def adopt(self, slots: dict[BufferId, Slot]) -> None:
        """Takes slots moved from another store (`regroup.move_buffers`)."""
        self._slots.update(slots)

    # ---- spans ---------------------------------------------------------------------------

    def spanning(self) -> bool:
        """Some buffer waits for other hosts (the common single-host case skips the rest)."""
        return bool(self._spans)

    def span(self, buffer_id: BufferId, devices: frozenset[int]) -> None:
        """The buffer, being computed, waits for a program over `devices`."""
        self._spans[buffer_id] = devices

    def spans_of(self, buffer_ids: Sequence[BufferId]) -> list[frozenset[int]]:
        """The spans of those buffers that are still being computed."""
        spans = self._spans
        return [spans[b] for b in buffer_ids if b in spans and self.computing(b)]

    def inherit(self, dst: BufferId, sources: Sequence[BufferId]) -> None:
        """`dst` is computed from `sources`: it waits for whatever peers they wait for."""
        if self._spans:
            spans = self.spans_of(sources)
            if spans:
                self._spans[dst] = frozenset().union(*spans)

    # ---- checking ------------------------------------------------------------------------

    def validate_state(self) -> None:
        """Raises AssertionError naming the first broken invariant (module docstring)."""
        for buffer_id, value in self._slots.items():
            if isinstance(value, Failed):
                if not isinstance(value.error, errors.IsthmusError):
                    raise AssertionError(f"buffer {buffer_id} failed with {value.error!r}")
            elif not isinstance(value, HostArray) and not hasattr(value, "is_ready"):
                raise AssertionError(f"buffer {buffer_id} holds {type(value).__name__}")
        for buffer_id, devices in self._spans.items():
            value = self._slots.get(buffer_id)
            if value is None or isinstance(value, (Failed, HostArray)):
                raise AssertionError(f"span of buffer {buffer_id}, which is not stored")
            if not devices or not isinstance(devices, frozenset):
                raise AssertionError(f"span of buffer {buffer_id} is {devices!r}")


def ids_of(ref: int | Sequence[BufferId], positions: Sequence[int]) -> list[BufferId]:
    """The buffers of a program's argument at `positions`: `ref` is a group base (position p
    is `ref + p`) or one id per position, as commands name arguments."""
    if isinstance(ref, int):
        return [BufferId(ref + p) for p in positions]
    return [ref[p] for p in positions]


def missing(buffer_id: BufferId) -> errors.IsthmusError:
    return errors.InternalError(
        f"buffer {buffer_id} is not on this host; the controller and worker disagree, "
        "which is a bug in isthmus: please report it.")
