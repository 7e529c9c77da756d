"""Control-plane messages between the controller and its workers.

Both ends are isthmus processes of the same version (checked at registration); messages are
frozen dataclasses in the fleet's codec (`codec.py`: msgpack, whose decoding builds only
registered records and values, never runs code), sent only after both ends proved that they
know the fleet's token (`auth.py`).

The commands themselves are defined in `commands.py`; this module holds the stream's own
messages. Commands flow controller -> worker in batches (`Batch`) and take effect in order.
A request (`commands.Request`) travels inside an `Ask` with a number; the worker answers with
`Reply`. A put's data and a fetch through a file travel in forms of their own (`PutBegin`,
`PutData`, `PutObjects`, `PutFile`, `FetchFile`), which carry their request number.
"""

from __future__ import annotations

import dataclasses
import struct
import typing

import numpy as np
import numpy.typing as npt

from isthmus import errors
from isthmus.ids import BufferId
from isthmus.transport.codec import Bulk, Codec, register_errors
from isthmus.transport.frames import Parts, Tailed

__all__ = ["Bulk"]  # senders wrap bulk bytes in it (`encode`)

PROTOCOL_VERSION = 13  # bump when a message changes shape
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


def encode(message: object) -> bytes | Parts:
    """A frame's payload: the message packed, or, when it holds `Bulk` bytes, the packed
    rest and those bytes as `Parts` (sent without being copied)."""
    packed, tails = CODEC.encode_parts(message)
    if not tails:
        return packed
    return Parts((_LENGTH.pack(len(packed)) + packed, *tails))


def decode(frame: bytes | Tailed) -> object:
    """The message of a frame `read_frame` returned (its bulk bytes as views of it)."""
    if not isinstance(frame, Tailed):
        return CODEC.decode(frame)
    return CODEC.decode(frame.packed, tail=frame.tail)


def dtype_name(dtype: npt.DTypeLike) -> str:
    """A numpy dtype as a name both ends can turn back into the dtype."""
    name = _NAMES.get(dtype)
    if name is None:
        name = np.dtype(dtype).name  # numpy builds it anew each time: ~2 us
        if len(_NAMES) < 256:
            _NAMES[dtype] = name
    return name


# What `dtype_of` gives: a numpy dtype, or `object` for a string array's.
NumpyDType = np.dtype | type[object]


def dtype_of(name: str) -> NumpyDType:
    dtype = _DTYPES.get(name)
    if dtype is None:
        import ml_dtypes

        dtype = object if name == "object" else np.dtype(getattr(ml_dtypes, name, name))
        if len(_DTYPES) < 256:
            _DTYPES[name] = dtype
    return dtype


_NAMES: dict[npt.DTypeLike, str] = {}  # dtype_name's and dtype_of's answers, a few in all
_DTYPES: dict[str, NumpyDType] = {}


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
    log: str = ""  # the file its output goes to ("": not a file), named in the controller's log
    # Per local device, the backend's attributes (`platforms.device_attributes`: a TPU's
    # coords and core_on_chip), as (name, int or list of ints) pairs.
    device_attributes: tuple[tuple[tuple[str, int | tuple[int, ...]], ...], ...] = ()


@_message
class Heartbeat:
    stats: dict[str, int]
    applied: int = 0  # weight of the commands applied (flow control), as in `Applied`
    queued: int = 0  # messages read off the stream that wait to be applied
    applying: str = ""  # what the command being applied waits for ("": none is)


@_message
class Leaving:
    """The worker ends its membership because of `reason` (it then closes its stream and
    registers afresh): the controller names the reason where it reports the loss."""

    reason: str


@_message
class Incident:
    """An error the worker logged (with its traceback, if any), for the controller's log
    (`worker/incidents.py`)."""

    level: str  # the record's level name
    source: str  # the logger that logged it
    message: str
    traceback: str = ""
    dropped: int = 0  # incidents before this one left only in the worker's log (rate limit)


@_message
class Applied:
    """Flow control: the worker has applied commands of this total weight (`weight`)."""

    total: int


@_message
class Reply:
    """The answer to a request: `value`, or `error` (an IsthmusError) when it failed."""

    request: int
    value: object = None
    error: errors.IsthmusError | None = None


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
    data: Bulk | memoryview  # Bulk when sent; a memoryview of the frame when received


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
    # The key of this worker's data server in this membership: a peer's request for one of
    # its buffers carries an HMAC of the buffer id under it, which only the controller hands
    # out (in `Pull`), so that a worker's memory lets nobody fetch another worker's buffers.
    data_key: str = ""


@_message
class Refused:
    reason: str


@_message
class Batch:
    """Commands to apply in order (`commands.Told`: this layer does not name the commands,
    which build on it)."""

    commands: tuple[object, ...]


@_message
class Ask:
    """A request numbered for its `Reply`."""

    request: int
    command: object  # a `commands.Request` (which this layer does not name)


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


# ---- how a put's data and a fetch through a file travel (`commands.Put`, `commands.Fetch`) ---

@_message
class PutBegin:
    """The layout of a put whose bytes follow as `PutData`."""

    buffer: BufferId
    device: int  # global device id
    memory_kind: str | None
    dtype: str  # numpy dtype name ("object" for strings)
    shape: tuple[int, ...]
    nbytes: int


@_message
class PutData:
    """Bytes of a put; the put completes (and is answered) with its last piece."""

    request: int
    buffer: BufferId
    offset: int
    data: Bulk | memoryview  # Bulk when sent; a memoryview of the frame when received
    last: bool


@_message
class PutWhole:
    """A put whose bytes are one piece (at most PIECE_BYTES): `PutBegin` and its one
    `PutData` in a single message, answered once stored."""

    request: int
    buffer: BufferId
    device: int
    memory_kind: str | None
    dtype: str
    shape: tuple[int, ...]
    data: Bulk | memoryview  # Bulk when sent; a memoryview of the frame when received


@_message
class PutObjects:
    """A string array (IFRT keeps these as host objects)."""

    request: int
    buffer: BufferId
    device: int
    value: np.ndarray  # of dtype object


@_message
class PutFile:
    """A put whose bytes wait in a file of the controller's shared directory (for a worker
    that answered the probe: it runs on the controller's machine); the worker maps the file,
    stores the buffer and answers."""

    request: int
    buffer: BufferId
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
    buffer: BufferId
    path: str


@_message
class Shutdown:
    reason: str


def weight(command: object) -> int:
    """A command's share of a worker's backlog, as both ends count it for flow control."""
    if isinstance(command, (PutData, PutWhole)):
        return 1 + len(command.data) // WEIGHT_BYTES
    return 1

