"""A host's reads of its buffers (readiness waits, fetches: `Reads`), and the ones in flight:
the buffers a fetch or readiness wait still needs.

A worker applies commands in arrival order, but a read of a buffer still being computed ends
later, in a thread. A program applied after the read that donates the buffer would free it
under the read; `DeviceHost.execute` asks `donated_in_flight` and donates a copy of such an
argument instead, so that the read sees the value, as the order of the commands says.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import numpy as np

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray
from isthmus.ids import BufferId
from isthmus.worker.buffers import BufferStore, ids_of
from isthmus.worker.slots import HostArray, already_done, block_all, computation_error, failing

_T = TypeVar("_T")


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

    def track(self, buffer_ids: Sequence[BufferId], read: Awaitable[_T]) -> Awaitable[_T]:
        """`read`, with `buffer_ids` counted from now (the commands applied after this one
        see them) until it ends."""
        for b in buffer_ids:
            self._count[b] = self._count.get(b, 0) + 1
        return self._ends(buffer_ids, read)

    async def _ends(self, buffer_ids: Sequence[BufferId], read: Awaitable[_T]) -> _T:
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


class Reads:
    """Readiness waits and fetches of a host's buffers. What is computed already is answered
    in the call; a wait for what is still being computed goes to a thread, counted in
    `in_flight` until it ends."""

    def __init__(self, buffers: BufferStore, pool: concurrent.futures.Executor) -> None:
        self.buffers = buffers
        self._pool = pool  # the host's, for the waits that block
        self.in_flight = ReadsInFlight()
        # A computed buffer's copy to the host is made in the call (a CPU buffer's costs
        # nothing). False: the copy is started and waited for in a thread, so that the
        # caller answers before the data is here (an accelerator's copy takes ~0.4 ms on a
        # TPU v5e, which the embedded server's client then spends on its next request
        # instead of waiting for the answer: `head.embedded_fleet` sets it there).
        self.copy_inline = True

    def all_ready(self, buffer_ids: Sequence[BufferId]) -> bool:
        """Every buffer is here, computed and without error (False when in doubt: `ready`
        then reports whatever is wrong)."""
        try:
            values = [self.buffers.value(b) for b in buffer_ids]
            for value in values:
                if not value.is_ready():
                    return False
                value.block_until_ready()  # ready: returns at once, or raises its error
        except Exception:  # noqa: BLE001
            return False
        return True

    def ready(self, buffer_ids: Sequence[BufferId]) -> Awaitable[None]:
        """Resolves when every buffer is computed; fails with the first buffer's error."""
        try:
            values = [self.buffers.value(b) for b in buffer_ids]
        except errors.IsthmusError as e:
            return failing(e)
        if all(v.is_ready() for v in values):  # answered now: a later donation cannot race
            try:
                for value in values:
                    value.block_until_ready()  # returns at once, or raises the stored error
            except Exception as e:  # noqa: BLE001
                return failing(computation_error(e))
            return already_done()
        return self.in_flight.track(buffer_ids, self._wait_ready(values))

    async def _wait_ready(self, values: list[JaxArray | HostArray]) -> None:
        pending = [v for v in values if not v.is_ready()]
        if pending:
            # Small computations finish within a turn of the event loop; a thread hand-off
            # costs more than that, so look once more before handing the wait to a thread.
            await asyncio.sleep(0)
            pending = [v for v in pending if not v.is_ready()]
        try:
            if pending:
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, block_all, pending)
            for value in values:
                value.block_until_ready()  # ready now: raises the stored error, if any
        except Exception as e:  # noqa: BLE001
            raise computation_error(e) from None

    def fetch(self, buffer_id: BufferId) -> Awaitable[np.ndarray]:
        """Resolves to the host copy of one buffer, once it is computed."""
        try:
            value = self.buffers.value(buffer_id)
            if not self.copy_inline and not isinstance(value, HostArray):
                value.copy_to_host_async()  # starts when its computation ends
            elif value.is_ready():  # the common case of a small program: no task, no turn
                done: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
                done.set_result(np.asarray(value))
                return done
        except errors.IsthmusError as e:
            return failing(e)
        except Exception:  # noqa: BLE001 - a failed computation: reported as below
            pass
        return self.in_flight.track([buffer_id], self._wait_value(value))

    async def _wait_value(self, value: JaxArray | HostArray) -> np.ndarray:
        try:
            if self.copy_inline:
                if not value.is_ready():
                    await asyncio.sleep(0)
                if value.is_ready():
                    return np.asarray(value)
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, np.asarray, value)
        except Exception as e:  # noqa: BLE001
            raise computation_error(e) from None
