"""What a command may ask of the host it is applied to (`Command.apply`).

`isthmus.worker.host.DeviceHost` is that host, in a worker process and in the embedded
backend; the worker layer imports this one, never the reverse, so the host is seen here
through `CommandHost` only. A command's `apply` calls exactly one of these methods (or one of
its parts' methods), and nothing else of the host; a method a new command needs is added
here and on the host (`tests/unit/test_device_host.py` checks that the host satisfies the
protocol, under mypy and by signature).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

import numpy as np

from isthmus import errors
from isthmus.ids import BufferId, ExecutableId
from isthmus.transport.messages import NumpyDType
from isthmus.transport.records import ColocatedProgram, CompiledInfo, CompileRequest, TraceOptions

__all__ = ["Box", "CheckpointIO", "CommandHost", "Part", "ProfileControl"]

Box = tuple[tuple[int, int], ...]  # per dimension, (start, stop)
# One piece of an assembled buffer: (source buffer, its box read, the box it fills).
Part = tuple[BufferId, tuple[slice, ...], tuple[slice, ...]]


class CheckpointIO(Protocol):
    """A host's checkpoint shards (`worker/persistence.py`)."""

    def write_shards(self, location: str, items: Sequence[tuple[BufferId, Box]]
                     ) -> Awaitable[int]:
        """Writes the buffers as shards (boxes) of `location`; resolves to the bytes."""
        ...

    def write_meta(self, location: str, dtype: str, shape: Sequence[int],
                   boxes: Sequence[Box]) -> Awaitable[None]:
        """Writes the index of the array saved at `location`."""
        ...

    def read_shards(self, location: str, dtype: str, shape: Sequence[int],
                    items: Sequence[tuple[BufferId, int, Box]]) -> Awaitable[None]:
        """Makes each buffer the part `box` of the saved array, on its device."""
        ...


class ColocatedCalls(Protocol):
    """A host's colocated Python calls (`worker/python_calls.py`)."""

    def call(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
             results: Sequence[int], stream: tuple[int, ...] = ()) -> Awaitable[None]:
        """Runs a colocated Python function (`commands.CallPython`)."""
        ...


class ProfileControl(Protocol):
    """A host's profiles (`worker/profiler.py`, `isthmus/profiling.py`)."""

    def start(self, trace: str, options: TraceOptions) -> Awaitable[bool]:
        """Starts the process's profiler; False when it records the trace already."""
        ...

    def stop(self, trace: str, directory: str, label: str) -> Awaitable[str | None]:
        """Stops the trace and writes the host's file; its path, or None."""
        ...


class CommandHost(Protocol):
    """The buffers and programs of one host, as the commands use them.

    Buffers are named by controller-chosen `BufferId`s and devices by their global ids;
    dispatch returns at once, and what is answered resolves later (`Awaitable`). A buffer
    that could not be made holds its error.
    """

    # ---- buffers -------------------------------------------------------------------------

    def put(self, buffer_id: BufferId, device_id: int, value: np.ndarray,
            memory_kind: str | None = None) -> Awaitable[None]:
        """Stores host data on a device; resolves once stored."""
        ...

    def fail(self, buffer_id: BufferId, error: errors.IsthmusError) -> None:
        """Makes the buffer an error: every use of it reports `error`."""
        ...

    def copy(self, src: BufferId, dst: BufferId, device_id: int,
             memory_kind: str | None = None) -> None:
        """Copies a buffer to another local device (or memory kind)."""
        ...

    def assemble(self, dst: BufferId, device_id: int, memory_kind: str | None,
                 dtype: NumpyDType | None, shape: tuple[int, ...], parts: Sequence[Part]
                 ) -> None:
        """Builds `dst` from boxes of local buffers (`dtype` None: a string array)."""
        ...

    def bitcast(self, src: BufferId, dst: BufferId, dtype: NumpyDType,
                shape: tuple[int, ...]) -> None:
        """Makes `dst` the bytes of `src` read as another dtype and shape."""
        ...

    def free(self, buffer_ids: Sequence[BufferId]) -> None:
        """Drops the buffers; ids not held here are ignored."""
        ...

    def ready(self, buffer_ids: Sequence[BufferId]) -> Awaitable[None]:
        """Resolves when the buffers are computed; fails with the first one's error."""
        ...

    def fetch(self, buffer_id: BufferId, nbytes: int = 0) -> Awaitable[np.ndarray]:
        """Resolves to the host copy of a buffer, once it is computed."""
        ...

    def held(self) -> Awaitable[list[int]]:
        """Resolves to the ids of every buffer the host holds (validate mode's check)."""
        ...

    def default_layout(self, dtype: str, shape: tuple[int, ...], device: int) -> Awaitable[str]:
        """Resolves to the backend's default layout of such an array on the device (global
        id), as XLA writes layouts ("{0,1:T(8,128)}")."""
        ...

    # ---- programs ------------------------------------------------------------------------

    def compile(self, executable_id: ExecutableId,
                request: CompileRequest | ColocatedProgram) -> Awaitable[CompiledInfo | None]:
        """Compiles and loads a program (None for colocated Python)."""
        ...

    def load(self, executable_id: ExecutableId,
             request: CompileRequest | ColocatedProgram) -> None:
        """Makes a program known, to be compiled when it first runs."""
        ...

    def drop_executable(self, executable_id: ExecutableId) -> None:
        """Unloads a program."""
        ...

    def execute(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
                results: Sequence[int], copy_first: frozenset[int] = frozenset()) -> None:
        """Runs a program on this host's shards (`commands.Execute`)."""
        ...

    def program_text(self, executable_id: ExecutableId) -> Awaitable[str]:
        """Resolves to the compiled program's text (`commands.ProgramText`)."""
        ...

    def cost_analysis(self, executable_id: ExecutableId) -> Awaitable[dict[str, object]]:
        """Resolves to XLA's cost analysis of the compiled program (`commands.CostAnalysis`)."""
        ...

    # ---- parts ---------------------------------------------------------------------------

    @property
    def python(self) -> ColocatedCalls:
        ...

    @property
    def checkpoints(self) -> CheckpointIO:
        ...

    @property
    def profiles(self) -> ProfileControl:
        ...
