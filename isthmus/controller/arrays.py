"""The array directory: arrays, the buffer groups they are made of, and their accounting.

A `BufferGroup` is one allocation: a buffer on each of its devices, named `base + position`,
so an array over a thousand hosts is one record, not a thousand. Commands that concern every
host of a group (run a program, free its outputs) are one shared message, sent once and
delivered to each host; the hosts work out their own positions. The controller's cost per
program therefore stays nearly flat as fleets grow.

An `Array` is a dtype, a global shape, a sharding and its shards, in the order of
`sharding.devices`. Most arrays are a whole group (`Array.group`). Arrays made of shards of
other arrays (disassembled, assembled, remapped) list their shards as `Buffer` views, one per
device, and share the groups they come from, as IFRT shares buffers. A shard is freed on its
worker when the last array holding it is released, or at once when an array holding it is
deleted (IFRT `Delete` frees the memory for every sharer).

Invariant: the controller holds no device data. A group is only names, places and states; the
bytes live on the workers that own its devices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable, Sequence

from isthmus import dtypes, errors
from isthmus.controller.fleet import Device
from isthmus.controller.sharding import Sharding
from isthmus.ids import BufferId, WorkerId

DELETED = ("the array was deleted, or donated to a computation that consumed it; keep a copy "
           "(or don't donate it) if you need it again.")


class BufferGroup:
    """The shard buffers of one allocation; position p is buffer `base + p` on `devices[p]`.

    State that is usually the same for every shard is kept once (`error`, `deleted`, `refs`);
    the per-position dictionaries hold the exceptions and stay None in the common case.
    """

    __slots__ = ("base", "devices", "workers", "nbytes", "memory_kind", "refs", "shard_refs",
                 "defined", "_waiting", "error", "errors", "deleted", "deleted_at", "freed",
                 "freed_at", "pins", "free_pending", "dispatched", "stored", "storing",
                 "_unanswered")

    def __init__(self, base: int, devices: tuple[Device, ...], workers: tuple[WorkerId, ...],
                 nbytes: tuple[int, ...], memory_kind: str | None = None) -> None:
        self.base = base
        self.devices = devices
        self.workers = workers  # the distinct workers of `devices`: where group commands go
        self.nbytes = nbytes  # per position
        self.memory_kind = memory_kind
        self.refs = 0  # arrays holding every shard
        self.shard_refs: dict[int, int] | None = None  # position -> arrays holding just it
        # Resolved once every worker has been told how to produce its bytes (None: already).
        self.defined: asyncio.Future[None] | None = None
        self._waiting = 0  # operations still to define some shard
        self.error: errors.IsthmusError | None = None  # every shard's, as far as known
        self.errors: dict[int, errors.IsthmusError] | None = None  # position -> its own
        self.deleted = False  # every shard deleted or donated
        self.deleted_at: set[int] | None = None
        self.freed = False  # every shard dropped on its worker
        self.freed_at: set[int] | None = None
        self.pins: dict[int, int] | None = None  # position -> transfers still reading it
        self.free_pending: set[int] | None = None  # freed once unpinned
        # A program's output: [perf_counter() at its dispatch], shared by its outputs, until
        # a client's wait times it (`counts.Counts.waited`); None otherwise.
        self.dispatched: list[float] | None = None
        # Positions whose host data its worker confirmed stored and ready (a put's answer):
        # when all are, the group is ready without asking the workers again.
        self.stored = 0
        # Resolved once the answers of puts that defined the group before they came are
        # recorded (None: none outstanding); a readiness wait waits on it, asking nothing.
        self.storing: asyncio.Future[None] | None = None
        self._unanswered = 0

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"BufferGroup({self.base}, {len(self.devices)} shards)"

    @property
    def ids(self) -> range:
        return range(self.base, self.base + len(self.devices))

    # ---- definition ----------------------------------------------------------------------

    def expect(self, count: int = 1) -> None:
        """`count` more operations will define shards; uses wait until they have."""
        if self.defined is None:
            self.defined = asyncio.get_running_loop().create_future()
        self._waiting += count

    def settle(self, count: int = 1) -> None:
        self._waiting -= count
        if self._waiting <= 0 and self.defined is not None:
            if not self.defined.done():
                self.defined.set_result(None)
            self.defined = None

    def expect_answers(self) -> None:
        """Puts whose answers the group will not wait for were sent (`answered` follows)."""
        if self.storing is None:
            self.storing = asyncio.get_running_loop().create_future()
        self._unanswered += 1

    def answered(self) -> None:
        self._unanswered -= 1
        if self._unanswered <= 0 and self.storing is not None:
            if not self.storing.done():
                self.storing.set_result(None)
            self.storing = None

    @property
    def all_stored(self) -> bool:
        """Every shard is host data its worker confirmed stored and ready."""
        return self.stored >= len(self.devices)

    # ---- state per position --------------------------------------------------------------

    def error_at(self, position: int) -> errors.IsthmusError | None:
        if self.errors is not None and position in self.errors:
            return self.errors[position]
        return self.error

    def set_error(self, position: int, error: errors.IsthmusError) -> None:
        if self.errors is None:
            self.errors = {}
        self.errors[position] = error

    def deleted_position(self, position: int) -> bool:
        return self.deleted or (self.deleted_at is not None and position in self.deleted_at)

    def freed_position(self, position: int) -> bool:
        return self.freed or (self.freed_at is not None and position in self.freed_at)

    def held(self, position: int) -> bool:
        """Some array still holds the shard at `position`."""
        return self.refs > 0 or bool(self.shard_refs and self.shard_refs.get(position, 0) > 0)

    def first_error(self) -> errors.IsthmusError | None:
        """The group's error, or its first shard's own, or None."""
        if self.error is not None:
            return self.error
        if self.errors:
            return self.errors[min(self.errors)]
        return None

    def first_problem(self) -> errors.IsthmusError | None:
        """The error a use of the whole group would meet (deleted included), or None."""
        error = self.first_error()
        if error is not None:
            return error
        if self.deleted or self.deleted_at:
            return errors.ArrayDeleted(DELETED)
        return None


class Buffer:
    """A view of one shard: position `position` of `group`."""

    __slots__ = ("group", "position")

    def __init__(self, group: BufferGroup, position: int) -> None:
        self.group = group
        self.position = position

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Buffer) and other.group is self.group
                and other.position == self.position)

    def __hash__(self) -> int:
        return hash((id(self.group), self.position))

    def __repr__(self) -> str:
        return f"Buffer({self.id} on {self.device})"

    @property
    def id(self) -> BufferId:
        return BufferId(self.group.base + self.position)

    @property
    def device(self) -> Device:
        return self.group.devices[self.position]

    @property
    def nbytes(self) -> int:
        return self.group.nbytes[self.position]

    @property
    def memory_kind(self) -> str | None:
        return self.group.memory_kind

    @property
    def error(self) -> errors.IsthmusError | None:
        return self.group.error_at(self.position)

    @error.setter
    def error(self, error: errors.IsthmusError) -> None:
        self.group.set_error(self.position, error)

    @property
    def deleted(self) -> bool:
        return self.group.deleted_position(self.position)

    @deleted.setter
    def deleted(self, value: bool) -> None:
        if value and not self.group.deleted:
            if self.group.deleted_at is None:
                self.group.deleted_at = set()
            self.group.deleted_at.add(self.position)

    @property
    def freed(self) -> bool:
        return self.group.freed_position(self.position)

    def check(self) -> None:
        """Raises the error a use of this buffer would meet, as far as the controller knows."""
        error = self.error
        if error is not None:
            raise error
        if self.deleted:
            raise errors.ArrayDeleted(DELETED)


@dataclasses.dataclass(eq=False, slots=True)
class Array:
    """A (possibly sharded) array; its shards are in the order of `sharding.devices`.

    Either `group` is set (the array is that whole group, position p = shard p) or `parts`
    lists its shards one by one.
    """

    dtype: dtypes.DType
    shape: tuple[int, ...]
    sharding: Sharding
    group: BufferGroup | None = None
    parts: tuple[Buffer, ...] | None = None
    error: errors.IsthmusError | None = None  # poisoned: every use reports this
    deleted: bool = False  # deleted or donated, as of the dispatch order
    # A delete or donation was requested; it acts in dispatch order (operations sent
    # before it still see the array), but the client already sees the array as deleted.
    delete_sent: bool = False
    released: bool = False

    @property
    def shards(self) -> tuple[Buffer, ...]:
        """One view per shard (built on demand for a whole group: O(shards))."""
        if self.parts is None:
            assert self.group is not None
            self.parts = tuple(Buffer(self.group, p) for p in range(len(self.group)))
        return self.parts

    @property
    def groups(self) -> list[BufferGroup]:
        """The groups the array's shards belong to, each once."""
        if self.group is not None:
            return [self.group]
        return list({id(b.group): b.group for b in self.shards}.values())

    def problem(self) -> errors.IsthmusError | None:
        """The error a use of the array would meet, or None."""
        if self.error is not None:
            return self.error
        if self.deleted:
            return errors.ArrayDeleted(
                "the array was deleted; create it again (or keep a copy) to use it.")
        if self.group is not None:
            return self.group.first_problem()
        for buffer in self.shards:
            error = buffer.error
            if error is not None:
                return error
            if buffer.deleted:
                return errors.ArrayDeleted(DELETED)
        return None

    def check(self) -> None:
        error = self.problem()
        if error is not None:
            raise error

    def consume(self) -> None:
        """The array's bytes are gone (deleted, or donated to a computation): every use of it,
        and of any array sharing its shards, reports so."""
        self.deleted = True
        if self.group is not None:
            self.group.deleted = True
        else:
            for buffer in self.shards:
                buffer.deleted = True

    @property
    def is_deleted(self) -> bool:
        if self.deleted or self.delete_sent:
            return True
        if self.group is not None:
            return self.group.deleted or bool(self.group.deleted_at)
        return any(b.deleted for b in self.shards)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def first_error(arrays: Iterable[Array]) -> errors.IsthmusError | None:
    """The error the first unusable array would raise, or None when all are usable."""
    for array in arrays:
        error = array.problem()
        if error is not None:
            return error
    return None


def groups_of(arrays: Iterable[Array]) -> list[BufferGroup]:
    """Every group the arrays' shards belong to, each once."""
    seen: dict[int, BufferGroup] = {}
    for array in arrays:
        for group in array.groups:
            seen.setdefault(id(group), group)
    return list(seen.values())


def whole_group(buffers: Sequence[Buffer]) -> BufferGroup | None:
    """The group when `buffers` are exactly its shards in position order, else None."""
    if not buffers:
        return None
    group = buffers[0].group
    if len(buffers) != len(group):
        return None
    for p, buffer in enumerate(buffers):
        if buffer.group is not group or buffer.position != p:
            return None
    return group
