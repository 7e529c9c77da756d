"""An executable as the controller keeps it: what it runs (its plan, of one of six kinds),
its outputs' and parameters' specs, and its life (`ExecutableState`, moved along `MOVES`).
The `Controller` (controller.py) makes, caches and releases them; the sessions' parts run
them (`frontend/execute.py:RUNNERS`)."""

from __future__ import annotations

import asyncio
import enum
from typing import ClassVar, NamedTuple, Protocol, TypeVar

from isthmus import errors
from isthmus.controller import sharding as sh
from isthmus.controller.fleet import Device
from isthmus.dtypes import DType
from isthmus.ids import ExecutableId, WorkerId
from isthmus.transport.records import Aval, ColocatedProgram, CompiledInfo, CompileRequest


class ProgramPlan(Protocol):
    """What an executable runs: a program compiled on the hosts (`CompileRequest`), a
    colocated Python function (`ColocatedProgram`), or a plan the controller carries out
    itself (`ReshardPlan`, `KeepPlan`, `ProfilePlan`, `PersistencePlan`). The front end runs
    each kind by its own runner (`frontend/execute.py`'s `RUNNERS`)."""

    # The session's own executable, never shared with another session and unloaded as soon
    # as it is released; else cached by program, options and devices.
    private: ClassVar[bool]
    on_hosts: ClassVar[bool]  # compiled or loaded on the hosts of its devices


_Plan = TypeVar("_Plan")


def plan_of(executable: Executable, kind: type[_Plan]) -> _Plan:
    """The executable's plan, which its runner knows to be of `kind`."""
    plan = executable.request
    if not isinstance(plan, kind):
        raise errors.InternalError(
            f"executable {executable.id} runs a {type(plan).__name__}, not a {kind.__name__}; "
            "this is a bug in isthmus: please report it.")
    return plan


class OutputSpec(NamedTuple):
    """One output of an executable, worked out once (`specs.py`) and kept: what each run's
    array of it is, and where."""

    aval: Aval
    sharding: sh.Sharding
    nbytes: tuple[int, ...]  # per shard, as the ledger counts them (a reshard's: none kept)
    # A small output's origin, for reading it ahead (`readahead.py`: the executable's
    # `readahead` table and the output's index); None: not read ahead.
    origin: tuple[dict[tuple[int, int], int], int] | None = None


class ParamSpec(NamedTuple):
    """One parameter of a compiled program, worked out once (`specs.py`) and kept: where an
    argument must be for it."""

    sharding: sh.Sharding | None  # the sharding the argument must have (None: not said)
    memory_kind: str


class InputSpec(NamedTuple):
    """One input of a colocated Python function, as it was specialized for."""

    dtype: DType
    shape: tuple[int, ...]
    sharding: sh.Sharding


def hosted(executable: Executable) -> CompileRequest | ColocatedProgram:
    """The program the hosts of an `on_hosts` executable compile or load."""
    plan = executable.request
    if not isinstance(plan, (CompileRequest, ColocatedProgram)):
        raise errors.InternalError(
            f"executable {executable.id} runs a {type(plan).__name__}, which the hosts do not "
            "load; this is a bug in isthmus: please report it.")
    return plan


class ExecutableState(enum.Enum):
    """Where an executable is in its life (`Executable.state`, moved only by `move`, along
    `MOVES`). Whether its program is refused (it crashed a worker) is beside this:
    `Executable.refused`, in any state."""

    COMPILING = "compiling"  # held by sessions; its compile on the hosts has not answered
    READY = "ready"  # held by sessions, and runnable
    IDLE = "idle"  # held by none, kept in the cache (`Controller._idle`); compiled or not yet
    FAILED = "failed"  # its compile failed (`Executable.error`); no longer listed
    DROPPED = "dropped"  # left the cache, or a private one released: unloaded from the hosts


_S = ExecutableState
MOVES: dict[ExecutableState, frozenset[ExecutableState]] = {
    _S.COMPILING: frozenset({_S.READY, _S.FAILED, _S.IDLE, _S.DROPPED}),
    _S.READY: frozenset({_S.IDLE, _S.DROPPED}),
    # Taken again (compiling still, or compiled), evicted, or its compile failed meanwhile.
    _S.IDLE: frozenset({_S.COMPILING, _S.READY, _S.FAILED, _S.DROPPED}),
    _S.FAILED: frozenset(),
    _S.DROPPED: frozenset(),
}


class Executable:
    """A program compiled for a list of devices, loaded on the workers that own them."""

    __slots__ = ("id", "key", "devices", "device_ids", "positions", "parts", "workers",
                 "compiled", "info", "refs", "error", "request", "epoch", "holders",
                 "output_specs", "input_specs", "param_specs", "dispatched",
                 "refused", "runs", "slices", "readahead", "placed", "state")

    def __init__(self, executable_id: ExecutableId, key: bytes, devices: tuple[Device, ...],
                 request: ProgramPlan) -> None:
        self.id = executable_id
        self.state = ExecutableState.READY if not request.on_hosts else (
            ExecutableState.COMPILING)
        self.key = key
        self.devices = devices
        self.device_ids = tuple(d.id for d in devices)
        self.positions = {d.id: p for p, d in enumerate(devices)}  # device id -> position
        self.request: ProgramPlan = request
        # The channels that were given the program, and the fleet epoch when that was last
        # checked (`Controller.ensure_loaded`). A worker compiles the program again by itself
        # when its collective group re-forms; a worker that replaced one must be given it.
        self.holders: dict[WorkerId, object] = {}
        self.epoch = -1
        # worker -> positions (in `devices`) of that worker's devices
        parts: dict[WorkerId, list[int]] = {}
        for position, device in enumerate(devices):
            parts.setdefault(device.worker, []).append(position)
        self.parts = {w: tuple(p) for w, p in parts.items()}
        self.workers = tuple(self.parts)  # where its commands go (the controller interns it)
        # Per output and parameter: a compiled program's from its compile's answer (specs.py),
        # a colocated function's and a reshard's from their first run.
        self.output_specs: list[OutputSpec] | None = None
        self.input_specs: list[InputSpec] | None = None  # per input of a colocated function
        self.param_specs: list[ParamSpec] | None = None
        # per parameter: the last sharding an argument passed the placement check in (the
        # same object again passes without a check: a loop's outputs share their sharding)
        self.placed: dict[int, object] = {}
        self.compiled: asyncio.Future[CompiledInfo] | None = None
        self.info: CompiledInfo | None = None
        self.error: errors.IsthmusError | None = None
        self.refs = 0
        # When an Execute of it was last dispatched (`Controller.ensure_loaded`'s count): a
        # lost worker's error names the last program it was given.
        self.dispatched = 0
        self.refused: str | None = None  # why it is refused (it crashed a worker), if it is
        self.runs = 0  # Executes dispatched (for the metrics)
        self.slices = tuple(sorted({d.slice_index for d in devices}))  # the slices it runs on
        # (output, position) -> runs read ahead since a client last took one (readahead.py)
        self.readahead: dict[tuple[int, int], int] = {}

    def move(self, to: ExecutableState) -> None:
        """Its next state, along `MOVES`; any other move is a bug in isthmus."""
        if to not in MOVES[self.state]:
            raise errors.InternalError(
                f"executable {self.id} cannot go from {self.state.value} to {to.value}; this "
                "is a bug in isthmus: please report it with the server log.")
        self.state = to
