"""Reads in flight on a host: the buffers a fetch or readiness wait still needs.

A worker applies commands in arrival order, but a read of a buffer still being computed ends
later, in a thread. A program applied after the read that donates the buffer would free it
under the read; `DeviceHost.execute` asks `donated_in_flight` and donates a copy of such an
argument instead, so that the read sees the value, as the order of the commands says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

from isthmus.ids import BufferId
from isthmus.worker.buffers import ids_of


class ReadsInFlight:
    """Buffer -> reads in flight. Empty in the common case (reads of computed buffers are
    answered at once and never counted), so checking it costs a program nothing."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[BufferId, int] = {}

    def __bool__(self) -> bool:
        return bool(self._count)

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self._count

    def track(self, buffer_ids: Sequence[BufferId], read: Awaitable[Any]) -> Awaitable[Any]:
        """`read`, with `buffer_ids` counted from now (the commands applied after this one
        see them) until it ends."""
        for b in buffer_ids:
            self._count[b] = self._count.get(b, 0) + 1
        return self._ends(buffer_ids, read)

    async def _ends(self, buffer_ids: Sequence[BufferId], read: Awaitable[Any]) -> Any:
        try:
            return await read
        finally:
            for b in buffer_ids:
                left = self._count[b] - 1
                if left:
                    self._count[b] = left
                else:
                    del self._count[b]

    def donated_in_flight(self, args: Sequence[int | Sequence[BufferId]],
                          positions: Sequence[int], donated: Sequence[int]) -> frozenset[int]:
        """The donated arguments (group base or ids per position, as `DeviceHost.execute`
        takes them) some local shard of which a read in flight still needs."""
        return frozenset(i for i in donated if i < len(args)
                         and any(b in self._count for b in ids_of(args[i], positions)))
