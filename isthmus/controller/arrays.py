"""The array directory: arrays, the shard buffers they are made of, and their accounting.

An `Array` is a dtype, a global shape, a sharding and one `Buffer` per device of the
sharding. Buffers are shared: disassembling an array, assembling one from single-device
arrays, or taking a fully replicated shard makes new arrays over the same buffers, as IFRT
does. A buffer is freed on its worker when the last array holding it is released, or at once
when an array holding it is deleted (IFRT `Delete` frees the memory for every sharer).

Invariant: the controller holds no device data. A `Buffer` is only a name, a place and a
state; the bytes live on the worker that owns `device`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable

from isthmus import dtypes, errors
from isthmus.controller.fleet import Device
from isthmus.controller.sharding import Sharding
from isthmus.ids import BufferId


class Buffer:
    """One shard's bytes on one device, as the controller knows them."""

    __slots__ = ("id", "device", "nbytes", "refs", "defined", "error", "deleted", "freed",
                 "memory_kind", "pins", "free_pending")

    def __init__(self, buffer_id: BufferId, device: Device, nbytes: int,
                 memory_kind: str | None = None) -> None:
        self.id = buffer_id
        self.device = device
        self.nbytes = nbytes
        self.memory_kind = memory_kind
        self.refs = 0  # arrays holding this buffer
        # Resolved once the worker has been told how to produce the bytes (None: already).
        self.defined: asyncio.Future[None] | None = None
        self.error: errors.IsthmusError | None = None  # known to the controller
        self.deleted = False  # deleted or donated: the bytes are gone
        self.freed = False  # the worker was told to drop it
        self.pins = 0  # transfers still reading it: freeing waits for them
        self.free_pending = False

    def check(self) -> None:
        """Raises the error a use of this buffer would meet, as far as the controller knows."""
        if self.error is not None:
            raise self.error
        if self.deleted:
            raise errors.ArrayDeleted(
                "the array was deleted, or donated to a computation that consumed it; "
                "keep a copy (or don't donate it) if you need it again.")


@dataclasses.dataclass(eq=False, slots=True)
class Array:
    """A (possibly sharded) array; its shards are in the order of `sharding.devices`."""

    dtype: dtypes.DType
    shape: tuple[int, ...]
    sharding: Sharding
    shards: tuple[Buffer, ...]
    error: errors.IsthmusError | None = None  # poisoned: every use reports this
    deleted: bool = False
    released: bool = False

    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.deleted:
            raise errors.ArrayDeleted(
                "the array was deleted; create it again (or keep a copy) to use it.")
        for buffer in self.shards:
            buffer.check()

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def first_error(arrays: Iterable[Array]) -> errors.IsthmusError | None:
    """The error the first unusable array would raise, or None when all are usable."""
    for array in arrays:
        try:
            array.check()
        except errors.IsthmusError as e:
            return e
    return None


def buffers_of(arrays: Iterable[Array]) -> list[Buffer]:
    return [b for a in arrays for b in a.shards]
