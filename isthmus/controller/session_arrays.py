"""Creating a session's arrays, and freeing them.

A new array gets a new buffer group. Its contents arrive from the client as host arrays: a
shard, or a whole array cut into its shards, is placed on its devices in the turn its host
buffer is here (`HostShard`; thousands a second, so no task each). The group is defined once
every expected piece has settled. `delete` frees an array's buffers at once, for every
sharer; `release` frees those that no other array holds. `SessionArrays` is the part of a
`Session` (session.py) that holds the session's arrays.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, Buffer, whole_group
from isthmus.controller.fleet import Device
from isthmus.controller.groups import BufferGroup, ShardState
from isthmus.controller.session_core import SessionCore, as_error
from isthmus.ids import BufferId
from isthmus.transport import commands as c


class HostShard(Protocol):
    """Host data for some shards of an array, here or to come."""

    def subscribe(self, receive: Callable[[np.ndarray | Exception], None]) -> None:
        """Calls `receive` once, with the data or why it will not come: at once if it is
        here, else in the turn it arrives."""


class HostData:
    """Host data that is here already, as a `HostShard` (benchmarks and tests that drive a
    session in-process)."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def subscribe(self, receive: Callable[[np.ndarray | Exception], None]) -> None:
        receive(self.value)


class SessionArrays:
    """Creating and freeing a session's arrays (a part of `Session`)."""

    def __init__(self, core: SessionCore) -> None:
        self.core = core
        self.controller = core.controller
        self.fleet = core.fleet
        self.dispatcher = core.dispatcher
        self.ledger = core.controller.ledger
        self._arrays: set[Array] = set()

    def close(self) -> None:
        """The session ends: it releases every array it still holds."""
        self.release(list(self._arrays))

    # ---- creating arrays -----------------------------------------------------------------

    def validate_shape(self, dtype: dtypes.DType, shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise errors.InvalidRequest(
                f"shape {shape} has a negative dimension; every dimension must be >= 0.")
        # Zero-sized dimensions count as 1: f32[3, 0, 2**62] holds nothing, but its other
        # dimensions still size every index, shard box and host view made of it.
        nbytes = math.prod(max(d, 1) for d in shape) * max(dtype.itemsize, 1)
        if nbytes > self.controller.config.max_array_bytes:
            raise errors.TooLarge(
                f"an array of shape {shape} and dtype {dtype.kind} spans {nbytes} bytes, over "
                f"the server's limit of {self.controller.config.max_array_bytes} bytes; split "
                "it, or start the server with a larger --max-array-bytes.")
        return shape

    def new_array(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
                  *, definers: int = 1) -> Array:
        """A new array over a new group, pending until `definers` operations settle (none:
        defined by the operation dispatched in this turn's order)."""
        devices = self.fleet.devices_of(sharding.devices)
        self._check_memory_kind(devices, sharding.memory_kind)
        nbytes = sh.shard_nbytes(sharding, shape, dtype.itemsize)
        group = self.ledger.new_group(devices, nbytes, sharding.memory_kind, definers=definers)
        return self.own(dtype, shape, sharding, group)

    def own(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
             group: BufferGroup) -> Array:
        """The session's array over a new group (its first holder)."""
        array = self.ledger.hold(Array(dtype, shape, sharding, group))
        self._arrays.add(array)
        return array

    def own_all(self, made: Sequence[tuple[dtypes.DType, tuple[int, ...], sh.Sharding,
                                           BufferGroup]]) -> list[Array]:
        """`own` of each (dtype, shape, sharding, new group): a program run's outputs."""
        arrays = [Array(dtype, shape, sharding, group) for dtype, shape, sharding, group in made]
        self.ledger.hold_new(arrays)
        self._arrays.update(arrays)
        return arrays

    def share(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
              buffers: Sequence[Buffer], error: errors.IsthmusError | None = None) -> Array:
        """A new array of this session over `buffers` (shards of existing arrays, perhaps
        another session's), holding them."""
        group = whole_group(buffers)
        if group is not None:
            array = Array(dtype, shape, sharding, group, error=error)
        else:
            array = Array(dtype, shape, sharding, parts=tuple(buffers), error=error)
        self.ledger.hold(array)
        self._arrays.add(array)
        return array

    def _check_memory_kind(self, devices: Sequence[Device], kind: str | None) -> None:
        if kind is None:
            return
        for device in devices:
            if kind not in device.memory_kinds:
                raise errors.InvalidRequest(
                    f"memory kind {kind!r} does not exist on device {device.id} (it has "
                    f"{', '.join(device.memory_kinds)}); pick one of those.")

    def make_array(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                   host: HostShard) -> Array:
        """An array whose full contents arrive as one host array, cut into its shards and
        placed in the turn it arrives (in this one if it is here)."""
        shape = self.validate_shape(dtype, shape)
        array = self.new_array(dtype, shape, sharding)
        group = array.group
        assert group is not None
        boxes = sh.shard_boxes(sharding, shape)
        host.subscribe(lambda value: self._arrived_whole(group, shape, boxes, value))
        return array

    def make_array_from_shards(self, dtype: dtypes.DType, shape: Sequence[int],
                               sharding: sh.Sharding,
                               pieces: Sequence[tuple[Sequence[int], HostShard]]) -> Array:
        """An array whose shards arrive as host arrays; `pieces` pairs device positions
        (indices into the sharding's device list) with the data all of them hold. Each is
        placed in the turn it arrives (in this one if it is here)."""
        shape = self.validate_shape(dtype, shape)
        count = len(sharding.devices)
        covered: set[int] = set()
        for positions, _ in pieces:
            for p in positions:
                if not 0 <= p < count or p in covered:
                    for _, unused in pieces:  # their host buffers are freed once here
                        unused.subscribe(_ignore)
                    return self.make_error_array(dtype, shape, sharding, errors.InvalidRequest(
                        f"shard index {p} is out of range or given twice for an array with "
                        f"{count} shards; send each shard index once."))
                covered.add(p)
        array = self.new_array(dtype, shape, sharding, definers=len(pieces))
        group = array.group
        assert group is not None
        boxes = sh.shard_boxes(sharding, shape)
        for positions, data in pieces:
            places, shards = list(positions), [boxes[p] for p in positions]

            def arrived(value: np.ndarray | Exception, places: list[int] = places,
                        shards: list[sh.Box] = shards) -> None:
                self._arrived(group, places, shards, value)

            data.subscribe(arrived)
        missing = [p for p in range(len(group)) if p not in covered]
        if missing:
            error = errors.InvalidRequest(
                f"no host data was given for shard(s) {missing[:8]} of the array; every "
                "addressable shard needs data.")
            group.fail(missing, error)
        return array

    def make_error_array(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                         error: errors.IsthmusError) -> Array:
        array = self.new_array(dtype, self.validate_shape(dtype, shape), sharding, definers=0)
        self.ledger.poison(array, error)
        assert array.group is not None
        array.group.fail(None, error)
        return array

    def _arrived_whole(self, group: BufferGroup, shape: tuple[int, ...],
                       boxes: Sequence[sh.Box], value: np.ndarray | Exception) -> None:
        positions = list(range(len(group)))
        if not isinstance(value, Exception) and tuple(value.shape) != shape:
            value = errors.InvalidRequest(
                f"host data has shape {tuple(value.shape)} but the array has shape {shape}; "
                "send data matching the declared shape.")
        if isinstance(value, Exception):
            self._shards_failed(group, positions, value)
            group.settle()
        else:
            self._place(group, positions, [value[sh.box_slices(b)] for b in boxes])

    def _arrived(self, group: BufferGroup, positions: list[int], boxes: list[sh.Box],
                 value: np.ndarray | Exception) -> None:
        if isinstance(value, Exception):
            self._shards_failed(group, positions, value)
            group.settle()
        else:
            self._place_shards(group, positions, boxes, value)

    def _place_shards(self, group: BufferGroup, positions: list[int], boxes: list[sh.Box],
                      value: np.ndarray) -> None:
        """Stores one host shard at `positions`; the group settles once it is stored (in
        this turn where every device took it at once)."""
        for box in boxes:
            if tuple(value.shape) != sh.shard_shape(box):
                self._shards_failed(group, positions, errors.InvalidRequest(
                    f"a host shard has shape {tuple(value.shape)} but the sharding puts "
                    f"shape {sh.shard_shape(box)} there; send shards of the shapes the "
                    "sharding implies."))
                group.settle()
                return
        self._place(group, positions, [value] * len(positions))

    def _place(self, group: BufferGroup, positions: list[int],
               values: Sequence[np.ndarray]) -> None:
        """Stores host data at positions of a group; it settles once they are stored."""
        try:
            placed, waits = self._start_puts(group, positions, values)
        except Exception as e:  # noqa: BLE001
            self._shards_failed(group, positions, e)
            group.settle()
            return
        if all(isinstance(w, asyncio.Future) for w in waits):
            # The usual case (a worker's answer, no file to remove after it): settled from
            # the answers' callbacks, no task per shard.
            answers = cast("list[asyncio.Future[None]]", waits)
            if (not all(a.done() for a in answers)
                    and all(v.nbytes <= c.ORDERED_PUT_BYTES for v in values)):
                # Each worker stores these before it applies its next command, and a failed
                # one becomes an error buffer there: what reads them may go out now, behind
                # them on the same channels, without waiting for the answers.
                group.expect_answers()
                group.settle()
                self._settle_when_answered(group, placed, answers, early=True)
            else:
                self._settle_when_answered(group, placed, answers)
        else:
            self.core.spawn(self._settle_puts(group, placed, waits))

    def _settle_when_answered(self, group: BufferGroup, placed: list[int],
                              answers: list[asyncio.Future[None]], early: bool = False
                              ) -> None:
        """Records the puts' outcomes once all are answered, then settles the group (or,
        `early`: it was settled when they were sent, and tells its readiness waits)."""
        left = [a for a in answers if not a.done()]
        count = [len(left)]

        def answered(_: object = None) -> None:
            count[0] -= 1
            if count[0] <= 0:
                self._record_puts(group, placed, [
                    a.exception() if not a.cancelled() else errors.InternalError(
                        "a put's answer was cancelled") for a in answers])
                if early:
                    group.answered()
                else:
                    group.settle()

        if not left:
            answered()
        for answer in left:
            answer.add_done_callback(answered)

    async def _settle_puts(self, group: BufferGroup, placed: list[int],
                           waits: list[Awaitable[None]]) -> None:
        self._record_puts(group, placed, await asyncio.gather(*waits, return_exceptions=True))
        group.settle()

    @staticmethod
    def _shards_failed(group: BufferGroup, positions: Sequence[int], e: Exception) -> None:
        group.fail(positions, as_error(e, "receiving the array's host data"))

    def _start_puts(self, group: BufferGroup, positions: Sequence[int],
                    values: Sequence[np.ndarray]) -> tuple[list[int], list[Awaitable[None]]]:
        waits, placed = [], []
        for p, value in zip(positions, values):
            if group.state_at(p) is ShardState.FREED:  # released before its data came
                continue
            device = group.devices[p]
            placed.append(p)
            waits.append(self.fleet.channel(device.worker).ask(
                c.Put(BufferId(group.base + p), device.id, value, group.memory_kind)))
            self.controller.counts.put_bytes += value.nbytes
        return placed, waits

    @staticmethod
    def _record_puts(group: BufferGroup, placed: list[int], outcomes: Sequence[Any]) -> None:
        for p, outcome in zip(placed, outcomes):
            if isinstance(outcome, BaseException):
                group.fail((p,), as_error(outcome, "storing host data"))
            else:
                group.stored(p)

    def definer_done(self, buffer: Buffer, error: errors.IsthmusError | None) -> None:
        """An operation that was to define `buffer` is over (with `error` if it failed)."""
        if error is not None:
            buffer.fail(error)
        buffer.group.settle()

    # ---- freeing -------------------------------------------------------------------------

    def delete(self, arrays: Sequence[Array]) -> Awaitable[None]:
        """Deletes arrays now: their buffers are freed even where other arrays share them."""
        result: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for array in arrays:
            self.ledger.request_delete(array)  # deleted in dispatch order: earlier reads see it

        def run() -> None:
            self.ledger.delete(arrays)
            result.set_result(None)

        self.dispatcher.submit([], run)
        return result

    def disown(self, array: Array) -> None:
        """Stops counting `array` among this session's arrays without releasing it: another
        session releases it, in that session's order (a kept array that a keep replaces)."""
        self._arrays.discard(array)

    def release(self, arrays: Sequence[Array]) -> None:
        """The client dropped these arrays; buffers no other array holds are freed (in
        dispatch order, after the operations already queued)."""
        for array in arrays:
            self._arrays.discard(array)
        groups, buffers = self.ledger.release(arrays)
        if groups or buffers:
            def free() -> None:
                self.ledger.free_groups(groups)
                self.ledger.free_buffers(buffers)

            self.dispatcher.submit([], free)

    def donate(self, array: Array) -> None:
        """The input of a DONATE_INPUT operation, from inside its dispatched operation:
        unusable afterwards, its buffers live on."""
        self.ledger.donate(array)

    def donate_in_order(self, array: Array) -> None:
        """`donate`, for an operation that needs no dispatch: it still acts in the order
        the requests came, after the operations already queued (they see the array)."""
        self.ledger.request_delete(array)
        self.dispatcher.submit([], lambda: self.donate(array))


def _ignore(value: object) -> None:
    """Receives host data nobody needs (of a request that failed)."""
