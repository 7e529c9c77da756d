"""What the controller asks of a worker, whatever carries the messages.

Commands are issued in order and take effect in that order on the worker. Methods that return
None are fire-and-forget: their failures land in the buffers they were to produce. Methods
that return an awaitable issue the command at once (so it is ordered with the others) and let
the caller wait for its outcome later.

`isthmus.worker.host.DeviceHost` implements this in-process (the embedded backend); a remote
worker's channel implements it over the network.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

import numpy as np

from isthmus import errors
from isthmus.ids import BufferId, ExecutableId


def answered(outcome: Awaitable[Any]) -> bool:
    """True when a channel's awaitable already holds its result (an in-process host, or a
    small ready buffer): the caller may take `outcome.result()` now, with no task."""
    return (isinstance(outcome, asyncio.Future) and outcome.done()
            and not outcome.cancelled() and outcome.exception() is None)


class Commands:
    """Fire-and-forget commands addressed to several workers, recorded once.

    The fleet delivers the same object to every worker of a program or buffer group, so a
    command for a thousand hosts is built (and, over the network, serialized) once. `calls`
    are (WorkerChannel method name, arguments) in order; `encoded` is for a transport to
    cache the serialized form in.
    """

    __slots__ = ("calls", "encoded")

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.calls = calls
        self.encoded: Any = None

    def apply(self, channel: Any) -> None:
        """Runs the commands on one channel, one method call each."""
        for name, args in self.calls:
            getattr(channel, name)(*args)


class WorkerChannel(Protocol):
    def put(self, buffer_id: BufferId, device_id: int, value: np.ndarray,
            memory_kind: str | None = None) -> Awaitable[None]:
        """Stores host data as a buffer on a device; resolves once it is stored.

        The caller must not modify `value` afterwards."""

    def fail(self, buffer_id: BufferId, error: errors.IsthmusError) -> None:
        """Defines a buffer as an error: every use of it reports `error`."""

    def copy(self, src: BufferId, dst: BufferId, device_id: int,
             memory_kind: str | None = None) -> None:
        """Copies a buffer to another device (or memory) of the same worker."""

    def pull(self, src: BufferId, peer: str, dst: BufferId, device_id: int,
             memory_kind: str | None) -> Awaitable[None]:
        """Fetches buffer `src` from the worker whose data server is at `peer` into `dst`.

        Only workers that are separate processes have peers; the embedded host has none."""

    def assemble(self, dst: BufferId, device_id: int, memory_kind: str | None,
                 dtype: np.dtype | None, shape: tuple[int, ...],
                 parts: Sequence[tuple[BufferId, tuple[slice, ...], tuple[slice, ...]]]) -> None:
        """Builds a buffer from boxes of the worker's buffers (`src[src_box]` -> `dst_box`);
        `dtype` is None for a string array's."""

    def bitcast(self, src: BufferId, dst: BufferId, dtype: np.dtype,
                shape: tuple[int, ...]) -> None:
        """Makes `dst` the bytes of `src` read as another dtype and shape."""

    def free(self, buffer_ids: Sequence[BufferId]) -> None:
        """Drops buffers; ids the worker does not hold are ignored (a group's ids span
        every worker of the group)."""

    def compile(self, executable_id: ExecutableId, request: Any) -> Awaitable[Any]:
        """Compiles and loads a program; resolves to its `CompiledInfo`."""

    def load(self, executable_id: ExecutableId, request: Any) -> None:
        """Makes a program known without waiting: the worker compiles it when it first
        runs it. For a worker that joined after the program was compiled elsewhere."""

    def drop_executable(self, executable_id: ExecutableId) -> None:
        """Unloads a program."""

    def refuse(self, executable_id: ExecutableId, device_ids: Sequence[int],
               error: errors.IsthmusError) -> None:
        """Unloads a program that crashed a worker and never compiles it again: every later
        Execute of it fails its outputs with `error`. Only worker processes are told (an
        in-process host's crash takes its controller with it)."""

    def execute(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
                results: Sequence[int], copy_first: frozenset[int] = frozenset()) -> None:
        """Runs a loaded program on the worker's shards of its arguments.

        The same command goes to every worker of the program; each uses the positions (in the
        program's device list) of its own devices. An argument is a group base (the shard at
        position p is buffer `base + p`) or the buffer ids of every position; `results` are
        the bases of the output groups.
        """

    def call_python(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
                    results: Sequence[int], stream: tuple[int, ...] = ()) -> Awaitable[None]:
        """Runs a colocated Python function on the worker's shards (args and results as in
        `execute`); resolves when its outputs are stored, or fails with the function's error."""

    def deliver(self, commands: Commands) -> None:
        """Takes commands shared with other workers (in order with the rest)."""

    def ready(self, buffer_ids: Sequence[BufferId]) -> Awaitable[None]:
        """Resolves when the buffers are computed; fails with the first one's error."""

    def fetch(self, buffer_id: BufferId, nbytes: int = 0) -> Awaitable[np.ndarray]:
        """Resolves to the host copy of one computed buffer (`nbytes`: its size, as the
        controller knows it; a channel may pick its path by it)."""

    def stats(self) -> dict[str, int]:
        """Live buffers and bytes on the worker."""

    def start_profile(self, trace: str, options: Any) -> Awaitable[bool]:
        """Starts jax's profiler in the worker's process for profile `trace` (options: a
        `records.TraceOptions`); programs run after this command are in it. Resolves
        to False when that process records the trace already (an in-process host shares its
        controller's process)."""

    def stop_profile(self, trace: str, directory: str, label: str) -> Awaitable[str | None]:
        """Stops profile `trace` and writes the worker's XSpace as
        `directory/<machine>-<label>.xplane.pb` (fsspec; `directory` "" drops it); resolves
        to the path, or None when the worker's process did not record the trace."""

    def write_shards(self, location: str, items: Sequence[tuple[BufferId, Any]]
                     ) -> Awaitable[int]:
        """Writes these buffers' data as the shards (boxes) of `location`; resolves to bytes."""

    def write_meta(self, location: str, dtype: str, shape: Sequence[int],
                   boxes: Sequence[Any]) -> Awaitable[None]:
        """Writes the index (dtype, shape, boxes) of the array saved at `location`."""

    def read_shards(self, location: str, dtype: str, shape: Sequence[int],
                    items: Sequence[tuple[BufferId, int, Any]]) -> Awaitable[None]:
        """Makes each buffer the part `box` of the array saved at `location`, on device
        `device_id` (items are `(buffer_id, device_id, box)`)."""
