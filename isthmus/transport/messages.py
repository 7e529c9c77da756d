"""Control-plane messages between the controller and its workers.

Both ends are isthmus processes of the same version (checked at registration); messages are
frozen dataclasses in the fleet's codec (`codec.py`: msgpack, whose decoding builds only
registered records and values, never runs code), sent only after both ends proved that they
know the fleet's token (`auth.py`).

Commands flow controller -> worker in batches (`Batch`) and take effect in order. Requests
that expect an answer carry a `request` number; the worker answers with `Reply`.
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from typing import Any

from isthmus.transport.codec import Bulk, Codec, register_errors
from isthmus.transport.frames import Parts, Tailed

__all__ = ["Bulk"]  # senders wrap bulk bytes in it (`encode`)

PROTOCOL_VERSION = 9  # bump when a message changes shape
PIECE_BYTES = 64 << 20  # bulk data on a worker's stream travels in pieces of this size
WEIGHT_BYTES = 64 << 10  # put data counts as one command per this many bytes (flow control)
ACK_EVERY = 128  # a worker reports its progress (`Applied`) at least this often, in weight

# What the worker's pulse RPC (`isthmus.Fleet/Alive`, from a thread of its own) answers.
ALIVE_OK = b"ok"  # a member: carry on
ALIVE_DROPPED = b"dropped"  # not (or no longer) a member: start afresh, never act on old state
ALIVE_STOP = b"stop"  # the controller is stopping: exit


_LENGTH = struct.Struct("<Q")
CODEC = Codec()  # every message record registers itself; so do the records replies carry
register_errors(CODEC)


_T = typing.TypeVar("_T")


@typing.dataclass_transform(frozen_default=True)
def _message(cls: type[_T]) -> type[_T]:
    """A frozen, slotted dataclass that travels in the fleet's codec."""
    return CODEC.record(dataclasses.dataclass(frozen=True, slots=True)(cls))


def encode(message: Any) -> bytes | Parts:
    """A frame's payload: the message packed, or, when it holds `Bulk` bytes, the packed
    rest and those bytes as `Parts` (sent without being copied)."""
    packed, tails = CODEC.encode_parts(message)
    if not tails:
        return packed
    return Parts((_LENGTH.pack(len(packed)) + packed, *tails))


def decode(frame: bytes | Tailed) -> Any:
    """The message of a frame `read_frame` returned (its bulk bytes as views of it)."""
    if not isinstance(frame, Tailed):
        return CODEC.decode(frame)
    return CODEC.decode(frame.packed, tail=frame.tail)


def dtype_name(dtype: Any) -> str:
    """A numpy dtype as a name both ends can turn back into the dtype."""
    import numpy as np

    return np.dtype(dtype).name


def dtype_of(name: str) -> Any:
    import ml_dtypes
    import numpy as np

    return object if name == "object" else np.dtype(getattr(ml_dtypes, name, name))


# ---- worker -> controller -------------------------------------------------------------------

@_message
class CrashReport:
    """The last worker process of this host slot died of a fatal signal (its crash records,
    `worker/crashes.py`)."""

    controller: int  # the incarnation of the controller it served (`Welcome.controller`)
    executable: int  # the executable it was dispatching (0: none)
    pid: int  # its process id
    fatal: str  # the first line of faulthandler's text ("Fatal Python error: ...")


@_message
class Register:
    """A worker introduces itself (the first message of its stream)."""

    version: int  # PROTOCOL_VERSION of the worker
    slice_index: int  # the slice it wants to serve in
    devices: int  # local devices it will bring
    platform: str  # "cpu", "cuda"
    device_kind: str
    data_address: str  # HOST:PORT of its peer data server
    hostname: str
    pid: int
    memory_kinds: tuple[str, ...] = ("device", "pinned_host", "unpinned_host")  # default 1st
    # Whether each device has a colocated CPU device beside it (accelerators do; see
    # `controller/fleet.py`); the worker serves them on a CPU client of its own.
    companions: bool = False
    crash: CrashReport | None = None  # how the slot's last worker process died, if it crashed


@_message
class Heartbeat:
    stats: dict[str, int]
    applied: int = 0  # weight of the commands applied (flow control), as in `Applied`


@_message
class Applied:
    """Flow control: the worker has applied commands of this total weight (`weight`)."""

    total: int


@_message
class Reply:
    """The answer to a request: `value`, or `error` (an IsthmusError) when it failed."""

    request: int
    value: Any = None
    error: Any = None


@_message
class SharedDir:
    """The worker read the controller's probe file: it shares the directory `path` (it runs on
    the controller's machine), so bulk data may travel through files there."""

    path: str


@_message
class FetchHeader:
    """The layout of a fetched buffer; its bytes follow as `Data`, then a `Reply`."""

    request: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@_message
class Data:
    """A piece of a fetched buffer, for request `request` (sent before its Reply)."""

    request: int
    offset: int
    data: Any  # Bulk when sent; a memoryview of the frame when received


# ---- controller -> worker -------------------------------------------------------------------

@_message
class Welcome:
    worker: int  # the worker's id in this fleet
    slice_index: int
    host_index: int
    heartbeat_interval: float  # seconds between heartbeats
    # (file, its contents) in the controller's shared directory: a worker that reads them
    # there answers with SharedDir. None: the controller has no shared directory.
    shared_probe: tuple[str, str] | None = None
    token: str = ""  # names this membership in the worker's pulses (`isthmus.Fleet/Alive`)
    # This controller process, among all that ever ran (random): a crash report names the
    # programs of the controller it came from, and another controller ignores it.
    controller: int = 0


@_message
class Refused:
    reason: str


@_message
class Batch:
    commands: tuple[Any, ...]


@_message
class Shared:
    """Commands encoded once for many workers (a tuple of commands, encoded); applied in
    order, in the place of the batch where they stand."""

    data: bytes


@_message
class FormGroup:
    """Join collective group `generation` as node `node_id` of `num_nodes`.

    The worker builds a new jaxlib client on the coordinator at `address`, moves its buffers
    into it and answers with its local jaxlib device ids (in local order).
    """

    request: int
    generation: int
    address: str
    node_id: int
    num_nodes: int
    reason: str = ""  # why the group re-forms (the losses since the last one), for errors
    gone: tuple[int, ...] = ()  # global ids of the devices that will not be in the group
    # The coordinator of the group's colocated CPU devices, on a client of their own
    # (accelerator fleets; "": none).
    companion_address: str = ""


@_message
class DeviceMap:
    """Global device id -> jaxlib device id in the current generation, for every device."""

    mapping: dict[int, int]


@_message
class PutBegin:
    buffer: int
    device: int  # global device id
    memory_kind: str | None
    dtype: str  # numpy dtype name ("object" for strings)
    shape: tuple[int, ...]
    nbytes: int


@_message
class PutData:
    """Bytes of a put; the put completes (and is answered) with its last piece."""

    request: int
    buffer: int
    offset: int
    data: Any  # Bulk when sent; a memoryview of the frame when received
    last: bool


@_message
class PutObjects:
    """A string array (IFRT keeps these as host objects)."""

    request: int
    buffer: int
    device: int
    value: Any


@_message
class PutFile:
    """A put whose bytes wait in a file of the controller's shared directory (for a worker
    that answered the probe: it runs on the controller's machine); the worker maps the file,
    stores the buffer and answers."""

    request: int
    buffer: int
    device: int
    memory_kind: str | None
    dtype: str
    shape: tuple[int, ...]
    path: str


@_message
class FetchFile:
    """Write buffer `buffer` into the new file `path` of the controller's shared directory
    and answer with (dtype name, shape)."""

    request: int
    buffer: int
    path: str


@_message
class Fail:
    buffer: int
    error: Any


@_message
class Copy:
    src: int
    dst: int
    device: int
    memory_kind: str | None


@_message
class Pull:
    """Fetch buffer `src` from the worker at `peer` into `dst` on `device`."""

    request: int
    src: int
    peer: str
    dst: int
    device: int
    memory_kind: str | None


@_message
class Assemble:
    dst: int
    device: int
    memory_kind: str | None
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[tuple[int, tuple[slice, ...], tuple[slice, ...]], ...]


@_message
class Bitcast:
    src: int
    dst: int
    dtype: str
    shape: tuple[int, ...]


@_message
class Free:
    buffers: tuple[int, ...] | range  # ids the worker does not hold are ignored


@_message
class Compile:
    request: int
    executable: int
    module: bytes
    compile_options: bytes
    device_ids: tuple[int, ...]  # global ids of the program, in device-assignment order
    replicas: int
    namespace: str = ""  # the tenant's, on a shared service: its own compile-cache entries


@_message
class Load:
    """A program the worker compiles when it first runs it (no answer): sent ahead of an
    Execute to a worker that joined after the program was compiled."""

    executable: int
    module: bytes
    compile_options: bytes
    device_ids: tuple[int, ...]
    replicas: int
    namespace: str = ""


@_message
class CompilePython:
    """A colocated Python program (`records.ColocatedProgram`) to unpickle."""

    request: int
    executable: int
    program: Any


@_message
class LoadPython:
    """A colocated Python program the worker unpickles when it is first called."""

    executable: int
    program: Any


@_message
class CallPython:
    """Runs a colocated Python program on the worker's shards; answered when it is done."""

    request: int
    executable: int
    args: tuple[int | tuple[int, ...], ...]  # per input: group base, or an id per position
    results: tuple[int, ...]  # per output: the base of its group
    stream: tuple[int, ...]  # calls of one stream run in order, others concurrently


@_message
class WriteShards:
    """Writes buffers as checkpoint shards (`worker/persistence.py`); answers the bytes."""

    request: int
    location: str
    items: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (buffer, box)


@_message
class WriteMeta:
    """Writes a saved array's index, once all its shards are written."""

    request: int
    location: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, int], ...], ...]


@_message
class ReadShards:
    """Reads the boxes of a saved array into new buffers on the worker's devices."""

    request: int
    location: str
    dtype: str
    shape: tuple[int, ...]
    items: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]  # (buffer, device, box)


@_message
class DropExecutable:
    executable: int


@_message
class Refuse:
    """The program crashed a worker: drop it, never compile it again, and fail the outputs
    of every Execute of it with `error` (a ProgramRefused)."""

    executable: int
    device_ids: tuple[int, ...]  # global ids of the program's devices, in its order
    error: Any


@_message
class Execute:
    """The same for every worker of the program; each takes its own device positions."""

    executable: int
    args: tuple[int | tuple[int, ...], ...]  # per argument: group base, or an id per position
    results: tuple[int, ...]  # per output: the base of its group
    copy_first: frozenset[int]


@_message
class Ready:
    request: int
    buffers: tuple[int, ...]


@_message
class Fetch:
    request: int
    buffer: int


@_message
class Shutdown:
    reason: str


@_message
class StartProfile:
    """Start jax's profiler in the worker's process for profile `trace`; answers whether it
    started (False: that process already records it). `worker/profiler.py`."""

    request: int
    trace: str
    host_tracer_level: int
    python_tracer_level: int
    advanced: tuple[tuple[str, Any], ...]  # (name, bool | int | str): tracer options


@_message
class StopProfile:
    """Stop profile `trace` and write the worker's XSpace as `directory`/HOST-`label`
    .xplane.pb (`directory` "": drop it); answers the path, or None if it did not record."""

    request: int
    trace: str
    directory: str
    label: str


def weight(command: Any) -> int:
    """A command's share of a worker's backlog, as both ends count it for flow control."""
    if isinstance(command, PutData):
        return 1 + len(command.data) // WEIGHT_BYTES
    return 1
