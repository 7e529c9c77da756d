"""A worker's membership of the fleet, as one state object (`Membership`, a part of
`WorkerAgent`): where it is (`Phase`, moved only along `MOVES`), what the group being formed
will lack and why, the weight of commands applied and acknowledged, and how it ends.

The agent feeds it what happens (`handle(event)`: welcomed, refused, a FormGroup read, a
group made active, the stream ended, told to stop, a command loop failed) and sends the
messages it returns; nothing else changes its fields. A move its phase does not lead to
raises `IllegalMove` and changes nothing, as the ledger's do (`controller/groups.py`).

    registering --Welcomed--> joined --GroupCalled--> forming --GroupActive--> in group
         ^                                              ^  |                      |
         |                                              |  +-- (a later call read) |
         +------------- StreamEnded (afresh) -----------+-------GroupCalled-------+
    any active phase --Stop--> stopping --StreamEnded--> ended (exit_code)
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from typing import ClassVar

from isthmus import errors
from isthmus.transport import messages as m

EXIT_SHUTDOWN = 0
EXIT_REFUSED = 2
EXIT_CONTROLLER_LOST = 3
# Seconds a loss's reason stays the answer to "why did my peer go" once its group formed.
LOSS_REASON_KEPT = 6.0


class Phase(enum.Enum):
    REGISTERING = "registering"  # asking a controller to take it (at start, or afresh)
    JOINED = "joined"  # welcomed; in no collective group yet
    FORMING = "forming"  # a FormGroup was read: the group before it (if any) is on its way out
    IN_GROUP = "in group"  # a member of collective group `generation`, its host serving
    STOPPING = "stopping"  # told to stop: the membership ends, and the process with it
    ENDED = "ended"  # out for good; the process exits with `exit_code`


_P = Phase
MOVES: dict[Phase, frozenset[Phase]] = {
    _P.REGISTERING: frozenset({_P.JOINED, _P.STOPPING, _P.ENDED, _P.REGISTERING}),
    _P.JOINED: frozenset({_P.FORMING, _P.REGISTERING, _P.STOPPING, _P.ENDED}),
    _P.FORMING: frozenset({_P.FORMING, _P.IN_GROUP, _P.REGISTERING, _P.STOPPING, _P.ENDED}),
    _P.IN_GROUP: frozenset({_P.FORMING, _P.REGISTERING, _P.STOPPING, _P.ENDED}),
    _P.STOPPING: frozenset({_P.STOPPING, _P.ENDED}),
    _P.ENDED: frozenset(),
}
ACTIVE = frozenset({_P.REGISTERING, _P.JOINED, _P.FORMING, _P.IN_GROUP})


class IllegalMove(errors.InternalError):
    """The membership was asked to move where its phase does not lead: a bug in isthmus."""


# ---- events ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Welcomed:
    """A controller took this worker (its `Welcome`)."""

    phases: ClassVar[frozenset[Phase]] = frozenset({_P.REGISTERING})


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """The controller refused this worker, or could not be reached: the process exits."""

    code: int = EXIT_REFUSED
    phases: ClassVar[frozenset[Phase]] = frozenset({_P.REGISTERING})


@dataclasses.dataclass(frozen=True, slots=True)
class GroupCalled:
    """A FormGroup was read off the stream (it may wait behind commands still applied)."""

    generation: int
    gone: frozenset[int] = frozenset()  # devices the coming group will not have
    reason: str = ""  # why it re-forms ("" for the first group, or one that grows)
    phases: ClassVar[frozenset[Phase]] = frozenset({_P.JOINED, _P.FORMING, _P.IN_GROUP,
                                                    _P.STOPPING})


@dataclasses.dataclass(frozen=True, slots=True)
class GroupActive:
    """The group of `generation` was formed and its host took over (the DeviceMap applied)."""

    generation: int
    phases: ClassVar[frozenset[Phase]] = frozenset({_P.FORMING, _P.STOPPING})


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEnded:
    """The stream to the controller ended: dropped, the controller gone, or stopping.
    `reusable`: the worker may register again (False: a shared service's join token, which is
    used up once a controller welcomed it)."""

    reusable: bool = True
    phases: ClassVar[frozenset[Phase]] = frozenset(ACTIVE | {_P.STOPPING})


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    """Told to stop (a signal, the controller's Shutdown or stop answer), with its exit code."""

    code: int = EXIT_SHUTDOWN
    phases: ClassVar[frozenset[Phase]] = frozenset(ACTIVE | {_P.STOPPING, _P.ENDED})


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """The command loop failed (a bug): the controller is told why before the stream ends."""

    reason: str
    phases: ClassVar[frozenset[Phase]] = frozenset(ACTIVE | {_P.STOPPING})


Event = Welcomed | Refused | GroupCalled | GroupActive | StreamEnded | Stop | Failed
EVENTS: tuple[type[Event], ...] = (Welcomed, Refused, GroupCalled, GroupActive, StreamEnded,
                                   Stop, Failed)


class Membership:
    """Where a worker stands with the fleet. `superseded` is set from the moment a FormGroup
    is read until the last group called is active: commands still applied then belong to a
    group on its way out, and nothing waits on its computations any more."""

    def __init__(self) -> None:
        self.phase = Phase.REGISTERING
        self.exit_code = EXIT_CONTROLLER_LOST  # what the process exits with once ENDED
        self.welcomed = False  # some controller has taken this process
        self.generation = -1  # the active group's (-1: none)
        self.called = -1  # the last FormGroup read's generation
        self.superseded = asyncio.Event()
        self.gone: frozenset[int] = frozenset()  # devices the group being formed lacks
        self.pending_reason = ""  # why it is being formed (FormGroup.reason)
        self.last_loss = ("", float("-inf"))  # the last reason given, and when (monotonic)
        self.applied = 0  # weight of the commands applied in this membership
        self.acked = 0  # ... of which the controller has been told (`Applied`, heartbeats)
        self.ending = asyncio.Event()  # set once stopping or ended: wakes the agent's wait

    @property
    def active(self) -> bool:
        """Registering, joined, forming or in a group: neither stopping nor ended."""
        return self.phase in ACTIVE

    @property
    def stopping(self) -> bool:
        return self.phase in (Phase.STOPPING, Phase.ENDED)

    def handle(self, event: Event) -> list[m.Leaving]:
        """Moves on `event`; returns the messages for the controller that it calls for."""
        if self.phase not in event.phases:
            raise IllegalMove(
                f"a worker's membership cannot take {type(event).__name__} while "
                f"{self.phase.value}; this is a bug in isthmus: please report it with the "
                "worker's log.")
        match event:
            case Welcomed():
                self._move(Phase.JOINED)
                self.welcomed = True
                self.applied = self.acked = 0
            case Refused(code=code):
                self.exit_code = code
                self._move(Phase.ENDED)
            case GroupCalled(generation=generation, gone=gone, reason=reason):
                self.called = max(self.called, generation)
                self.gone = gone
                self.pending_reason = reason
                if reason:
                    self.last_loss = (reason, time.monotonic())
                self.superseded.set()
                if self.phase is not Phase.STOPPING:
                    self._move(Phase.FORMING)
            case GroupActive(generation=generation):
                self.generation = generation
                if generation >= self.called:  # no later FormGroup waits behind it
                    self.superseded.clear()
                    if self.phase is not Phase.STOPPING:
                        self._move(Phase.IN_GROUP)
            case StreamEnded(reusable=reusable):
                if self.phase is Phase.STOPPING or (self.welcomed and not reusable):
                    self._move(Phase.ENDED)
                else:  # register afresh: the last membership's buffers are gone
                    self._move(Phase.REGISTERING)
                    self.generation = self.called = -1
                    self.superseded.clear()
                    self.gone = frozenset()
                    self.pending_reason = ""
            case Stop(code=code):
                if self.phase is not Phase.ENDED:
                    self.exit_code = code
                    self._move(Phase.STOPPING)
            case Failed(reason=reason):
                return [m.Leaving(reason)]
        return []

    def count(self, weight: int) -> m.Applied | None:
        """Commands of `weight` were applied; the acknowledgement to send, when one is due
        (every `m.ACK_EVERY`; heartbeats carry the count between)."""
        self.applied += weight
        if self.applied - self.acked >= m.ACK_EVERY:
            self.acked = self.applied
            return m.Applied(self.applied)
        return None

    def acknowledge(self) -> int:
        """The applied weight a heartbeat reports (it acknowledges all of it)."""
        self.acked = self.applied
        return self.applied

    def loss_reason(self) -> str:
        """Why the group is re-forming (the controller's words), or why it last did if that
        was recent; "" when there is none."""
        if self.superseded.is_set() and self.pending_reason:
            return self.pending_reason
        reason, at = self.last_loss
        return reason if time.monotonic() - at < LOSS_REASON_KEPT else ""

    def _move(self, to: Phase) -> None:
        if to not in MOVES[self.phase]:
            raise IllegalMove(
                f"a worker's membership cannot go from {self.phase.value} to {to.value}; "
                "this is a bug in isthmus: please report it with the worker's log.")
        self.phase = to
        if to in (Phase.STOPPING, Phase.ENDED):
            self.ending.set()
