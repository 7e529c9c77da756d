"""Arrays: a dtype, a global shape, a sharding, and the shards they are made of.

An `Array`'s shards are in the order of `sharding.devices`. Most arrays are a whole buffer
group (`Array.group`, groups.py). Arrays made of shards of other arrays (disassembled,
assembled, remapped) list their shards as `Buffer` views, one per device, and share the
groups they come from, as IFRT shares buffers. A shard is freed on its worker when the last
array holding it is released, or at once when an array holding it is deleted (IFRT `Delete`
frees the memory for every sharer). The ledger (ledger.py) does both.

An array's own state (`ArrayState`) says whether the client may still use it:

    LIVE --delete requested--> DELETING --its turn in the dispatch order--> DELETED
    LIVE --donated, in the dispatch order--> DELETED

The client sees a DELETING array as deleted at once; operations dispatched before the delete
still see it LIVE, as they would have when they were asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

from isthmus import dtypes, errors
from isthmus.controller.fleet import Device
from isthmus.controller.groups import GONE, BufferGroup, IllegalTransition
from isthmus.controller.sharding import Sharding
from isthmus.ids import BufferId


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
        """Why the shard failed, or None (its deletion is not an error: `problem`)."""
        return self.group.reason_at(self.position)

    def fail(self, reason: errors.IsthmusError) -> None:
        self.group.fail((self.position,), reason)

    @property
    def gone(self) -> bool:
        """Deleted (or freed after its deletion): no array may use its bytes."""
        return self.group.gone_at(self.position)

    def problem(self) -> errors.IsthmusError | None:
        return self.group.problem_at(self.position)

    def check(self) -> None:
        """Raises the error a use of this buffer would meet, as far as the controller knows."""
        error = self.problem()
        if error is not None:
            raise error


class ArrayState(enum.Enum):
    """Whether the client may still use an array (its shards have states of their own)."""

    __hash__ = object.__hash__  # members are singletons: sets and tables hash them fast

    LIVE = "live"
    DELETING = "deleting"  # a delete was asked for; it acts in dispatch order
    DELETED = "deleted"  # deleted or donated, as of the dispatch order


A = ArrayState
_LIVE, _DELETED = A.LIVE, A.DELETED  # for the hot paths (a global is cheaper to look up)
ARRAY_LEGAL: dict[ArrayState, frozenset[ArrayState]] = {
    A.LIVE: frozenset({A.DELETING, A.DELETED}),
    A.DELETING: frozenset({A.DELETED}),
    A.DELETED: frozenset(),
}


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
    state: ArrayState = ArrayState.LIVE  # changed only by `move`

    def move(self, new: ArrayState) -> None:
        """The array's only transition; an illegal one is refused (IllegalTransition)."""
        if new not in ARRAY_LEGAL[self.state]:
            raise IllegalTransition(
                f"an array cannot go from {self.state.value} to {new.value}; this is a bug "
                "in isthmus: please report it.")
        self.state = new

    @property
    def shards(self) -> tuple[Buffer, ...]:
        """One view per shard (O(shards) for a whole group: made on each call)."""
        if self.parts is not None:
            return self.parts
        assert self.group is not None
        return tuple(Buffer(self.group, p) for p in range(len(self.group)))

    @property
    def groups(self) -> list[BufferGroup]:
        """The groups the array's shards belong to, each once."""
        if self.group is not None:
            return [self.group]
        assert self.parts is not None
        return list({id(b.group): b.group for b in self.parts}.values())

    def problem(self) -> errors.IsthmusError | None:
        """The error a use of the array would meet, or None."""
        if self.error is not None:
            return self.error
        if self.state is _DELETED:
            return errors.ArrayDeleted(
                "the array was deleted; create it again (or keep a copy) to use it.")
        if self.group is not None:
            return self.group.first_problem()
        for buffer in self.shards:
            error = buffer.problem()
            if error is not None:
                return error
        return None

    def check(self) -> None:
        error = self.problem()
        if error is not None:
            raise error

    @property
    def is_deleted(self) -> bool:
        """What the client's IsDeleted sees: a delete was asked for (in order or not), or a
        shard is gone (deleted through another array that shares it)."""
        if self.state is not _LIVE:
            return True
        if self.group is not None:
            return self.group.any_in(*GONE) and any(
                self.group.gone_at(p) for p in range(len(self.group)))
        return any(b.gone for b in self.shards)

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
    seen: dict[BufferGroup, None] = {}  # a group hashes as itself (its identity)
    for array in arrays:
        group = array.group
        if group is not None:  # a whole group (a step's arguments): no list made
            seen[group] = None
            continue
        for group in array.groups:
            seen[group] = None
    return list(seen)


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


__all__ = ["Array", "ArrayState", "Buffer", "BufferGroup", "first_error",
           "groups_of", "whole_group"]
