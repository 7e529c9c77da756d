"""The commands a controller gives a worker, each defined once.

A command is a record: its fields are its encoding (it travels in the fleet's codec as it
is), and its `apply` is its handling on a host (`host.CommandHost`: a
`isthmus.worker.host.DeviceHost`, in-process or in a worker process). Every channel takes
commands through two calls:

    channel.send(Copy(src, dst, device, None))          # fire-and-forget
    info = await channel.ask(Compile(executable, req))  # answered

A worker process applies what arrives the same way (`command.apply(host)`), apart from the
few commands whose handling needs the process itself (listed below); a lost worker's
stand-in drops what is sent and fails what is asked. Adding a command is a record here and
the host's method it calls (`host.py` and the host).

Fire-and-forget commands take effect in order with the rest; their failures land in the
buffers they were to produce (`produces`). A `Request` is issued at once, in order, and its
awaitable resolves with what `apply` resolved to on the worker.

What a worker process does beside a record's own `apply` (`worker/applying.py`), and why
it cannot be the record's: each needs state of the process that outlives its hosts (a
worker's host is replaced whenever its collective group re-forms) or a transfer that only a
process with a network makes.

- `Execute`: the process's crash record names the program while jaxlib dispatches it
  (`worker/crashes.py`); before it, the worker compiles a program its current host lacks
  and waits for the collective programs before it.
- `Compile`, `Load`, `DropExecutable`, `Refuse`: the process keeps every program it was
  given across collective groups (compiled again at its first run on a new host), and the
  refused ones; `Compile` also names the program in the crash record, and its reply leaves
  out jax's avals (`CompiledInfo.param_avals`), which stay on the worker. `ProgramText` and
  `CostAnalysis` compile a program the current host lacks first, as `Execute` does.
- `Fetch`: a large result goes back on the control stream in pieces (`FetchHeader`, `Data`).
- `Pull`: the process's peer client fetches the source from another worker's data server
  (an in-process host has no peers: its `apply` refuses).
- `Put`: a remote channel sends its bytes in forms of their own (`PutBegin`/`PutData`,
  `PutWhole`, `PutObjects`, `PutFile`, in `messages.py`), picked by size and place, which
  neither end copies and the worker reassembles before it stores them; the record itself
  (in the codec like every command) is what the in-process host and the channels take.

Every other command, `Ready` included, is applied by its record alone; a request whose
answer waits for computations (`waits_for_computations`) is asked again of the new host if
the collective group re-forms meanwhile.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Awaitable, Iterable, Sequence
from typing import ClassVar, Generic, TypeVar, cast

import numpy as np
import numpy.typing as npt

from isthmus import errors
from isthmus.ids import BufferId, ExecutableId
from isthmus.transport import messages as m
from isthmus.transport.host import Box, CommandHost, Part
from isthmus.transport.messages import CODEC, NumpyDType, dtype_name, dtype_of
from isthmus.transport.records import ColocatedProgram, CompiledInfo, CompileRequest, TraceOptions

__all__ = [
    "Assemble", "Bitcast", "CallPython", "Command", "Compile", "CostAnalysis", "Copy",
    "DefaultLayout", "DropExecutable", "Execute", "Fail", "Fetch", "Free", "Held", "Load",
    "ProgramText", "Pull", "Put", "ReadShards", "Ready", "Refuse",
    "Request", "StartProfile", "StopProfile", "Told", "WriteMeta", "WriteShards",
    "dtype_field", "dtype_name", "refs",
]

_T = TypeVar("_T", covariant=True)  # what a request answers
_C = TypeVar("_C")

# Per program argument: a group base (position p's shard is `base + p`), or an id per position.
Refs = tuple[int | tuple[BufferId, ...], ...]


class Command:
    """A fire-and-forget command: `apply` returns nothing worth waiting for."""

    __slots__ = ()

    def apply(self, host: CommandHost) -> Awaitable[object] | None:
        """Carries the command out on `host`."""
        raise NotImplementedError

    def produces(self) -> tuple[BufferId, ...]:
        """The buffers the command makes: they hold its error when it cannot be applied."""
        return ()


class Request(Command, Generic[_T]):
    """A command that is answered: `apply` returns an awaitable of the answer."""

    __slots__ = ()

    # The answer waits for computations: a worker asks it again of its new host when its
    # collective group re-forms (where one stuck on a lost peer has become an error).
    waits_for_computations: ClassVar[bool] = False

    def apply(self, host: CommandHost) -> Awaitable[_T]:
        raise NotImplementedError


# What a batch (`messages.Batch`) carries, applied in order: commands, requests (in an `Ask`),
# commands shared with other workers, and the forms a put's data and a fetch through a file
# travel in.
Told = (Command | m.Ask | m.Shared | m.PutBegin | m.PutData | m.PutWhole | m.PutObjects
        | m.PutFile | m.FetchFile)


@typing.dataclass_transform(frozen_default=True)
def _command(cls: type[_C]) -> type[_C]:
    """A frozen, slotted dataclass in the fleet's codec."""
    return CODEC.record(dataclasses.dataclass(frozen=True, slots=True)(cls))


def dtype_field(dtype: npt.DTypeLike | None) -> str | None:
    """A dtype as a command carries it: its name, or None for a string array's."""
    return None if dtype is None or np.dtype(dtype) == object else dtype_name(dtype)


def _dtype(name: str | None) -> NumpyDType | None:
    return None if name is None else dtype_of(name)


def refs(args: Iterable[int | Iterable[BufferId]]) -> Refs:
    """Program arguments as commands carry them (`Execute.args`)."""
    return tuple(a if isinstance(a, int) else tuple(a) for a in args)


# A worker stores host data of at most this many bytes before it applies its next command
# (larger data is placed from a thread): a command behind such a put on the same channel
# finds the buffer, or the put's error in it.
ORDERED_PUT_BYTES = 1 << 20


# ---- buffers ------------------------------------------------------------------------------

@_command
class Put(Request[None]):
    """Stores host data as a buffer on a device; answered once stored. The caller must not
    modify `value` afterwards. Over the network its bytes travel in forms of their own
    (`PutBegin`/`PutData`, `PutWhole`, `PutObjects` or `PutFile`, `messages.py`): the
    transport picks by size and place."""

    buffer: BufferId
    device: int  # global device id
    value: np.ndarray
    memory_kind: str | None = None

    def apply(self, host: CommandHost) -> Awaitable[None]:
        return host.put(self.buffer, self.device, self.value, self.memory_kind)

    def produces(self) -> tuple[BufferId, ...]:
        return (self.buffer,)


@_command
class Fail(Command):
    """Defines a buffer as an error: every use of it reports `error`."""

    buffer: BufferId
    error: errors.IsthmusError

    def apply(self, host: CommandHost) -> None:
        host.fail(self.buffer, self.error)


@_command
class Copy(Command):
    """Copies a buffer to another device (or memory) of the same worker."""

    src: BufferId
    dst: BufferId
    device: int
    memory_kind: str | None

    def apply(self, host: CommandHost) -> None:
        host.copy(self.src, self.dst, self.device, self.memory_kind)

    def produces(self) -> tuple[BufferId, ...]:
        return (self.dst,)


@_command
class Pull(Request[None]):
    """Fetches buffer `src` from the worker whose data server is at `peer` into `dst`.

    Only worker processes have peers (their agent carries this out); the embedded host has
    none."""

    src: BufferId
    peer: str
    dst: BufferId
    device: int
    memory_kind: str | None
    mac: bytes = b""  # of `src` under the peer's data key (`RemoteWorker.pull_mac`)

    def apply(self, host: CommandHost) -> Awaitable[None]:
        raise errors.InternalError("an in-process host has no peers to pull from; this is a "
                                   "bug in isthmus: please report it.")

    def produces(self) -> tuple[BufferId, ...]:
        return (self.dst,)


@_command
class Assemble(Command):
    """Builds a buffer from boxes of the worker's buffers (`src[src_box]` -> `dst_box`)."""

    dst: BufferId
    device: int
    memory_kind: str | None
    dtype: str | None  # `dtype_field`: None for a string array
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    def apply(self, host: CommandHost) -> None:
        host.assemble(self.dst, self.device, self.memory_kind, _dtype(self.dtype), self.shape,
                      self.parts)

    def produces(self) -> tuple[BufferId, ...]:
        return (self.dst,)


@_command
class Bitcast(Command):
    """Makes `dst` the bytes of `src` read as another dtype and shape."""

    src: BufferId
    dst: BufferId
    dtype: str
    shape: tuple[int, ...]

    def apply(self, host: CommandHost) -> None:
        host.bitcast(self.src, self.dst, dtype_of(self.dtype), self.shape)

    def produces(self) -> tuple[BufferId, ...]:
        return (self.dst,)


@_command
class Free(Command):
    """Drops buffers; ids the worker does not hold are ignored (a group's ids span every
    worker of the group)."""

    buffers: tuple[BufferId, ...] | range  # a range: a group's ids

    def apply(self, host: CommandHost) -> None:
        host.free(cast("Sequence[BufferId]", self.buffers))


@_command
class Ready(Request[None]):
    """Answered when the buffers are computed; fails with the first one's error."""

    buffers: tuple[BufferId, ...]

    waits_for_computations: ClassVar[bool] = True

    def apply(self, host: CommandHost) -> Awaitable[None]:
        return host.ready(self.buffers)


@_command
class Fetch(Request[np.ndarray]):
    """Answered with the host copy of one computed buffer (`nbytes`: its size, as the
    controller knows it; a transport may pick its path by it)."""

    buffer: BufferId
    nbytes: int = 0

    waits_for_computations: ClassVar[bool] = True

    def apply(self, host: CommandHost) -> Awaitable[np.ndarray]:
        return host.fetch(self.buffer, self.nbytes)


@_command
class DefaultLayout(Request[str]):
    """Answered with the backend's default layout of an array of `dtype` (a numpy name)
    and `shape` on `device` (global id), as XLA writes it: a TPU's are tiled, and often
    not row-major."""

    dtype: str
    shape: tuple[int, ...]
    device: int

    def apply(self, host: CommandHost) -> Awaitable[str]:
        return host.default_layout(self.dtype, self.shape, self.device)


@_command
class Held(Request[list[int]]):
    """Answered with the ids of every buffer the host holds, once the commands before it are
    applied: validate mode's check at stop (`Controller.validate_hosts`)."""

    def apply(self, host: CommandHost) -> Awaitable[list[int]]:
        return host.held()


# ---- programs -----------------------------------------------------------------------------

@_command
class Compile(Request[CompiledInfo | None]):
    """Compiles and loads a program; answered with its `CompiledInfo` (None for colocated
    Python, which is unpickled instead)."""

    executable: ExecutableId
    program: CompileRequest | ColocatedProgram

    def apply(self, host: CommandHost) -> Awaitable[CompiledInfo | None]:
        return host.compile(self.executable, self.program)


@_command
class Load(Command):
    """Makes a program known without waiting: the worker compiles it when it first runs it
    (for a worker that joined after the program was compiled elsewhere)."""

    executable: ExecutableId
    program: CompileRequest | ColocatedProgram

    def apply(self, host: CommandHost) -> None:
        host.load(self.executable, self.program)


@_command
class DropExecutable(Command):
    """Unloads a program."""

    executable: ExecutableId

    def apply(self, host: CommandHost) -> None:
        host.drop_executable(self.executable)


@_command
class Refuse(Command):
    """The program crashed a worker: unload it and never compile it again; every later
    Execute of it fails its outputs with `error` (a ProgramRefused). Only worker processes
    are told (an in-process host's crash takes its controller with it)."""

    executable: ExecutableId
    device_ids: tuple[int, ...]  # global ids of the program's devices, in its order
    error: errors.IsthmusError

    def apply(self, host: CommandHost) -> None:
        host.drop_executable(self.executable)


@_command
class ProgramText(Request[str]):
    """Answered with the compiled program's text as XLA prints it (the client's
    `compiled.as_text()`); "" where the backend prints none. Asked only when a client asks:
    printing a large program costs milliseconds."""

    executable: ExecutableId

    def apply(self, host: CommandHost) -> Awaitable[str]:
        return host.program_text(self.executable)


@_command
class CostAnalysis(Request[dict[str, object]]):
    """Answered with XLA's cost analysis of the compiled program (the client's
    `compiled.cost_analysis()`); {} where the backend gives none."""

    executable: ExecutableId

    def apply(self, host: CommandHost) -> Awaitable[dict[str, object]]:
        return host.cost_analysis(self.executable)


@_command
class Execute(Command):
    """Runs a loaded program on the worker's shards of its arguments.

    The same command goes to every worker of the program; each uses the positions (in the
    program's device list) of its own devices. Arguments listed in `copy_first` are copied
    before the call so that donation cannot consume them.
    """

    executable: ExecutableId
    args: Refs  # per argument: group base, or an id per position
    results: tuple[int, ...]  # per output: the base of its group
    copy_first: frozenset[int] = frozenset()

    def apply(self, host: CommandHost) -> None:
        host.execute(self.executable, self.args, self.results, self.copy_first)


@_command
class CallPython(Request[None]):
    """Runs a colocated Python function on the worker's shards (args and results as in
    `Execute`); answered when its outputs are stored, or with the function's error."""

    executable: ExecutableId
    args: Refs
    results: tuple[int, ...]
    stream: tuple[int, ...] = ()  # calls of one stream run in order, others concurrently

    def apply(self, host: CommandHost) -> Awaitable[None]:
        return host.python.call(self.executable, self.args, self.results, self.stream)


# ---- checkpoints and profiles -------------------------------------------------------------

@_command
class WriteShards(Request[int]):
    """Writes buffers as the shards (boxes) of `location` (`worker/persistence.py`);
    answered with the bytes written."""

    location: str
    items: tuple[tuple[BufferId, Box], ...]  # (buffer, box)

    def apply(self, host: CommandHost) -> Awaitable[int]:
        return host.checkpoints.write_shards(self.location, self.items)


@_command
class WriteMeta(Request[None]):
    """Writes the index (dtype, shape, boxes) of the array saved at `location`, once all its
    shards are written."""

    location: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]

    def apply(self, host: CommandHost) -> Awaitable[None]:
        return host.checkpoints.write_meta(self.location, self.dtype, self.shape, self.boxes)


@_command
class ReadShards(Request[None]):
    """Makes each buffer the part `box` of the array saved at `location`, on its device."""

    location: str
    dtype: str
    shape: tuple[int, ...]
    items: tuple[tuple[BufferId, int, Box], ...]  # (buffer, device, box)

    def apply(self, host: CommandHost) -> Awaitable[None]:
        return host.checkpoints.read_shards(self.location, self.dtype, self.shape,
                                            self.items)

    def produces(self) -> tuple[BufferId, ...]:
        return tuple(buffer for buffer, _, _ in self.items)


@_command
class StartProfile(Request[bool]):
    """Starts jax's profiler in the worker's process for profile `trace`; programs run after
    it are in it. Answered False when that process records the trace already (an in-process
    host shares its controller's process). `worker/profiler.py`, `isthmus/profiling.py`."""

    trace: str
    options: TraceOptions

    def apply(self, host: CommandHost) -> Awaitable[bool]:
        return host.profiles.start(self.trace, self.options)


@_command
class StopProfile(Request[str | None]):
    """Stops profile `trace` and writes the worker's XSpace as
    `directory/<machine>-<label>.xplane.pb` (fsspec; `directory` "" drops it); answered with
    the path, or None when the worker's process did not record the trace."""

    trace: str
    directory: str
    label: str

    def apply(self, host: CommandHost) -> Awaitable[str | None]:
        return host.profiles.stop(self.trace, self.directory, self.label)
