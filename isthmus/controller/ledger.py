"""The ledger: every live buffer group, the arrays holding it, and each change of their state.

Everything that changes a shard's or an array's state goes through here: naming groups,
holding and releasing them, deletion and donation, pins of a move's sources from its dispatch
to its last command, failures (a slice lost, or taken from a lease) and frees on the workers.
The states and their legal transitions are in groups.py (shards) and arrays.py (arrays); a
move they do not allow raises `IllegalTransition` and changes nothing. `validate_state()`
checks that the records agree with each other (the unit tests call it after each step).

Frees are the only commands the ledger sends; they go out in the caller's turn, which is the
session's dispatch order (a delete or release is queued behind the operations that came
before it, so those still find their inputs on the workers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from isthmus import errors
from isthmus.controller.arrays import Array, ArrayState, Buffer, whole_group
from isthmus.controller.fleet import Device
from isthmus.controller.groups import (
    DEFINED,
    DELETED,
    FREED,
    GONE,
    LEGAL,
    BufferGroup,
    check_move,
)
from isthmus.controller.transitions import DEFAULT_SIZE, Transitions
from isthmus.ids import BufferId, WorkerId
from isthmus.transport import commands as c

ALL_FREED = frozenset({FREED})  # a group every shard of which is freed


class FreeChannel(Protocol):
    def send(self, command: c.Free) -> None: ...


class FleetForFrees(Protocol):
    """What the ledger asks of the fleet: names of workers, and a way to send them frees."""

    @property
    def workers(self) -> Iterable[WorkerId]: ...

    def worker_set(self, workers: Iterable[WorkerId]) -> tuple[WorkerId, ...]: ...

    def multicast(self, workers: tuple[WorkerId, ...], command: c.Free) -> None: ...

    def channel(self, worker: WorkerId) -> FreeChannel: ...


def _joined(ranges: list[range]) -> range | tuple[BufferId, ...]:
    """Groups' ids as one Free carries them: a range when they follow one another (one
    group's, or a program run's outputs freed together: compact on the wire), else each id."""
    if len(ranges) == 1:
        return ranges[0]
    ranges.sort(key=_start)
    if any(a.stop != b.start for a, b in zip(ranges, ranges[1:])):
        return tuple(BufferId(i) for one in ranges for i in one)
    return range(ranges[0].start, ranges[-1].stop)


def _start(ids: range) -> int:
    return ids.start


class Ledger:
    """The controller's buffer groups and the arrays that hold them."""

    def __init__(self, fleet: FleetForFrees, history: int = DEFAULT_SIZE) -> None:
        self.fleet = fleet
        # The last `history` moves of shards, with their causes (`isthmus status --buffer`).
        self.transitions = Transitions(history)
        self._log = self.transitions if history > 0 else None
        self._next_buffer_id = 1
        self._live: dict[BufferId, BufferGroup] = {}  # by base id, until every shard is freed
        self._holders: set[Array] = set()  # arrays counted in their groups' refs

    # ---- groups and holders --------------------------------------------------------------

    def new_group(self, devices: tuple[Device, ...], nbytes: tuple[int, ...],
                  memory_kind: str | None = None, workers: tuple[WorkerId, ...] | None = None,
                  definers: int = 0) -> BufferGroup:
        """Names a buffer on each device (ids `base .. base + len(devices) - 1`): pending
        until `definers` operations settle, or defined at once when there are none (the
        operation that makes them is dispatched in this turn's order)."""
        base = self._next_buffer_id
        self._next_buffer_id += len(devices)
        if workers is None:
            workers = self.fleet.worker_set(d.worker for d in devices)
        group = BufferGroup(base, devices, workers, nbytes, memory_kind, definers,
                            self._log)
        self._live[BufferId(base)] = group
        return group

    def new_groups(self, devices: tuple[Device, ...],
                   shapes: Sequence[tuple[tuple[int, ...], str | None]],
                   workers: tuple[WorkerId, ...]) -> list[BufferGroup]:
        """`new_group` of each (nbytes, memory kind) of `shapes` over the same devices,
        defined at once (a program run's outputs): their ids follow one another, and their
        making is one entry of the log."""
        first = base = self._next_buffer_id
        step, log, live = len(devices), self._log, self._live
        groups = []
        for nbytes, memory_kind in shapes:
            group = BufferGroup(base, devices, workers, nbytes, memory_kind)
            group.log = log
            live[BufferId(base)] = group
            groups.append(group)
            base += step
        self._next_buffer_id = base
        if log is not None and base > first:
            log.record(first, base - first, None, None, DEFINED)
        return groups

    def hold_new(self, arrays: Sequence[Array]) -> None:
        """`hold` of each array, every one over a whole group (a program run's outputs)."""
        holders = self._holders
        held = len(holders)
        holders.update(arrays)
        if len(holders) != held + len(arrays):
            raise errors.InternalError("an array was held twice; this is a bug in isthmus.")
        for array in arrays:
            array.group.refs += 1  # type: ignore[union-attr]  # a whole group's, as said

    def hold(self, array: Array) -> Array:
        """`array` holds its shards from now until it is released."""
        held = len(self._holders)
        self._holders.add(array)
        if len(self._holders) == held:
            raise errors.InternalError("an array was held twice; this is a bug in isthmus.")
        if array.group is not None:
            array.group.refs += 1
        else:
            for buffer in array.shards:
                group = buffer.group
                if group.shard_refs is None:
                    group.shard_refs = {}
                group.shard_refs[buffer.position] = group.shard_refs.get(buffer.position, 0) + 1
        return array

    def holds(self, array: Array) -> bool:
        return array in self._holders

    def release(self, arrays: Iterable[Array]) -> tuple[list[BufferGroup], list[Buffer]]:
        """The arrays stop holding their shards (those released already are skipped); returns
        the groups and shards no array holds any more, for `free` in dispatch order."""
        groups: list[BufferGroup] = []
        buffers: list[Buffer] = []
        for array in arrays:
            try:
                self._holders.remove(array)
            except KeyError:  # released already
                continue
            group = array.group
            if group is not None:
                group.refs -= 1
                if group.refs <= 0:
                    if group.shard_refs:
                        buffers.extend(Buffer(group, p) for p in range(len(group))
                                       if not group.held(p))
                    else:
                        groups.append(group)
                continue
            for buffer in array.shards:
                shard_refs = buffer.group.shard_refs
                assert shard_refs is not None
                shard_refs[buffer.position] -= 1
                if not buffer.group.held(buffer.position):
                    buffers.append(buffer)
        return groups, buffers

    # ---- deletion and donation -----------------------------------------------------------

    def request_delete(self, array: Array) -> None:
        """The client asked to delete (or donate) `array`: it sees it deleted from now on,
        while the operations dispatched before still use it. Idempotent."""
        if array.state is ArrayState.LIVE:
            array.move(ArrayState.DELETING)

    def delete(self, arrays: Iterable[Array]) -> None:
        """In dispatch order: the arrays' shards are deleted and freed at once, for every
        array that shares them (IFRT `Delete`). An array deleted or donated earlier owns
        nothing any more (its shards are gone, or another array's now) and is skipped."""
        live = [a for a in arrays if a.state is not ArrayState.DELETED]
        for array in live:
            self.consume(array)
        self.free_groups([a.group for a in live if a.group is not None])
        self.free_buffers([b for a in live if a.group is None for b in a.shards])

    def consume_all(self, arrays: Sequence[Array]) -> None:
        """`consume` of each (a program run's donated arguments), the common case of a whole
        group whose shards move together in one pass, with one log entry for adjacent
        groups."""
        moved: list[tuple[int, int, object]] = []
        for array in arrays:
            group = array.group
            if (group is None or group.states_apart is not None or group.state in GONE
                    or array.state is ArrayState.DELETED):
                self.consume(array)  # shard by shard, or checked the long way
                continue
            array.move(ArrayState.DELETED)
            if DELETED not in LEGAL[group.state]:
                check_move(group.state, DELETED, repr(group))
            moved.append((group.base, len(group.devices), group.state))
            group.state = DELETED
        if moved and self._log is not None:
            self._log.record_groups(moved, DELETED)

    def consume(self, array: Array) -> None:
        """In dispatch order: the array's bytes are gone (deleted, or donated to a program
        that overwrites them): every use of it, and of any array sharing its shards, says so.
        The shards stay on the workers until freed."""
        array.move(ArrayState.DELETED)
        if array.group is not None:
            array.group.delete()
        else:
            for buffer in array.shards:
                buffer.group.delete((buffer.position,))

    def donate(self, array: Array) -> None:
        """In dispatch order: `array` was donated to a new array over the same shards (a
        view): it is unusable, its shards live on in the new one. An array deleted earlier
        in the order stays so."""
        if array.state is not ArrayState.DELETED:
            array.move(ArrayState.DELETED)

    # ---- pins and frees ------------------------------------------------------------------

    def pin(self, buffer: Buffer) -> None:
        """A move reads `buffer` from its dispatch until `unpin`: it is not freed before."""
        buffer.group.pin(buffer.position)

    def unpin(self, buffer: Buffer) -> None:
        if buffer.group.unpin(buffer.position):
            self.free_buffers([buffer])

    def free_groups(self, groups: Sequence[BufferGroup]) -> None:
        """Drops every shard of the groups on their workers (in dispatch order): one shared
        command for the groups that live on the same workers (a step's old parameters are
        freed by one command)."""
        by_workers: dict[tuple[WorkerId, ...], list[range]] = {}
        freed: list[tuple[int, int, object]] = []  # for the log: (base, shards, old state)
        live = self._live
        for group in groups:
            if group.states_apart is None and not group.pins:  # the common case
                if group.state is FREED:
                    continue
            elif group.all_in(FREED):
                continue
            elif group.pins or group.any_in(FREED):  # shard by shard
                self.free_buffers([Buffer(group, p) for p in range(len(group))])
                continue
            base, count = group.base, len(group.devices)
            if group.states_apart is None:  # every shard FREED at once: legal from all but FREED
                freed.append((base, count, group.state))
                group.state = FREED
            else:
                group.free()
            live.pop(base, None)  # type: ignore[call-overload]  # a base is its BufferId
            ids = by_workers.get(group.workers)
            if ids is None:
                ids = by_workers[group.workers] = []
            ids.append(range(base, base + count))
        if freed and self._log is not None:
            self._log.record_groups(freed, FREED)
        for workers, ids in by_workers.items():
            self.fleet.multicast(workers, c.Free(_joined(ids)))

    def free_buffers(self, buffers: Sequence[Buffer]) -> None:
        """Drops single shards on their workers (in dispatch order); a pinned one is freed
        at its last unpin."""
        by_worker: dict[WorkerId, list[BufferId]] = {}
        for buffer in buffers:
            group, position = buffer.group, buffer.position
            if group.state_at(position) is FREED:
                continue
            if group.pinned(position):
                group.defer_free(position)
                continue
            group.free((position,))
            if group.all_in(FREED):
                self._live.pop(BufferId(group.base), None)
            by_worker.setdefault(buffer.device.worker, []).append(buffer.id)
        for worker, ids in by_worker.items():
            self.fleet.channel(worker).send(c.Free(tuple(ids)))

    # ---- failures ------------------------------------------------------------------------

    def poison(self, array: Array, error: errors.IsthmusError | None) -> None:
        """Every use of `array` reports `error` from now on (None: nothing to report; an
        array made from a poisoned one takes its error along). The array's own error is set
        here only."""
        if error is None:
            return
        if array.error is not None:
            raise errors.InternalError(
                f"an array poisoned with {array.error.message!r} was poisoned again; this is "
                "a bug in isthmus: please report it.")
        array.error = error

    def poison_slice(self, slice_index: int, error: errors.IsthmusError) -> None:
        """Every buffer on the slice is gone: uses of it report `error` (DATA_LOSS)."""
        with self.transitions.caused_by(f"slice {slice_index} lost"):
            for group in self._live.values():
                positions = [p for p, device in enumerate(group.devices)
                             if device.slice_index == slice_index and group.reason_at(p) is None]
                if positions:
                    group.fail(positions, error)

    def evict_slice(self, slice_index: int, error: errors.IsthmusError) -> None:
        """Every buffer on the slice is dropped from its (live) workers and reports `error`
        on use: the slice was taken from the lease that made them (a shared service)."""
        self.poison_slice(slice_index, error)
        with self.transitions.caused_by(f"slice {slice_index} taken from its lease"):
            self.free_buffers([Buffer(group, position) for group in list(self._live.values())
                               for position, device in enumerate(group.devices)
                               if device.slice_index == slice_index])

    # ---- reading -------------------------------------------------------------------------

    def accounting(self) -> dict[WorkerId, dict[str, int]]:
        """Live buffers and bytes per worker, as the controller counts them."""
        result: dict[WorkerId, dict[str, int]] = {
            w: {"buffers": 0, "bytes": 0} for w in self.fleet.workers}
        for group in self._live.values():
            for position, device in enumerate(group.devices):
                if group.state_at(position) is FREED:
                    continue
                entry = result.setdefault(device.worker, {"buffers": 0, "bytes": 0})
                entry["buffers"] += 1
                entry["bytes"] += group.nbytes[position]
        return result

    def state_of(self, buffer_id: int) -> str:
        """A buffer's state now ("freed" once its group has left the ledger, or for an id
        never named)."""
        for base, group in self._live.items():
            if base <= buffer_id < base + len(group):
                return group.state_at(buffer_id - base).value
        return FREED.value

    def live_groups(self) -> list[BufferGroup]:
        return list(self._live.values())

    def not_freed(self) -> dict[WorkerId, set[int]]:
        """Per worker, the ids of its buffers not freed: what its host holds once every
        command sent to it has been applied (`Controller.validate_hosts` checks this)."""
        held: dict[WorkerId, set[int]] = {}
        for group in self._live.values():
            for p, device in enumerate(group.devices):
                if group.state_at(p) is not FREED:
                    held.setdefault(device.worker, set()).add(group.base + p)
        return held

    def validate_state(self) -> None:
        """Raises AssertionError where the ledger's records disagree: a group's counts with
        the arrays that hold it, a freed group still listed, a pin on a freed shard."""
        live = self._live
        groups: dict[int, BufferGroup] = {}
        for base, group in live.items():
            assert group.base == base, f"{group!r} listed under {base}"
            groups[id(group)] = group
        refs: dict[int, int] = {}
        shard_refs: dict[int, dict[int, int]] = {}
        for array in self._holders:
            whole = array.group
            if whole is not None:
                assert array.parts is None, f"{array!r} is a group and parts"
                key = id(whole)
                groups[key] = whole
                refs[key] = refs.get(key, 0) + 1
                continue
            assert array.parts is not None and whole_group(array.parts) is None, (
                f"{array!r} lists the shards of one whole group as parts")
            for buffer in array.parts:
                groups[id(buffer.group)] = buffer.group
                counts = shard_refs.setdefault(id(buffer.group), {})
                counts[buffer.position] = counts.get(buffer.position, 0) + 1
        for key, group in groups.items():
            group.validate()
            assert group.refs == refs.get(key, 0), (
                f"{group!r}: refs {group.refs}, held by {refs.get(key, 0)} arrays")
            if group.shard_refs or key in shard_refs:
                held = {p: n for p, n in (group.shard_refs or {}).items() if n}
                assert held == shard_refs.get(key, {}), (
                    f"{group!r}: shard refs {held}, held by {shard_refs.get(key, {})}")
            if group.states() != ALL_FREED:
                assert live.get(BufferId(group.base)) is group, (
                    f"{group!r} has shards not freed but is not listed")
            else:
                assert live.get(BufferId(group.base)) is not group, (
                    f"{group!r} freed but still live")
