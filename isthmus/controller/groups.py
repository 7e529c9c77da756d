"""Buffer groups and the state of each shard: the ledger's records (ledger.py keeps them).

A `BufferGroup` is one allocation: a buffer on each of its devices, named `base + position`,
so an array over a thousand hosts is one record, not a thousand. Commands that concern every
host of a group (run a program, free its outputs) are one shared message, sent once and
delivered to each host; the hosts work out their own positions. The controller's cost per
program therefore stays nearly flat as fleets grow.

Each shard is in exactly one `ShardState`, and the transitions below are the only way to
change it (`BufferGroup._move`, which refuses an illegal one with `IllegalTransition`):

    PENDING --settle--> DEFINED --stored--> STORED          (PENDING --stored--> STORED too)
    PENDING | DEFINED | STORED --fail--> FAILED
    any but FREED --delete--> DELETED --free--> FREED      (any but FREED --free--> FREED)

The group keeps one common state and the positions that differ from it, so a group whose
shards move together costs O(1) per transition, not O(shards). Why a shard failed (its
reason) is kept apart from its state: a failed shard that is deleted or freed still reports
it to the arrays that hold it. How many arrays hold a shard, and how many moves read it
(pins), are counts beside the state; the ledger (ledger.py) changes them.

The record itself is plain data: names, places, states, reasons and counts. What the
controller keeps for a group that is not its state (the futures readers wait on while it is
being defined and while its puts' answers are on the way, the timing of a program's output
and the values read ahead for a client) is a `Beside` next to it, made when first needed; a
program's outputs need none unless their values are read ahead or the metrics time them.

Invariant: the controller holds no device data. A group is only names, places and states; the
bytes live on the workers that own its devices.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable

import numpy as np

from isthmus import errors
from isthmus.controller.fleet import Device
from isthmus.controller.transitions import Transitions
from isthmus.ids import WorkerId

DELETED_MESSAGE = ("the array was deleted, or donated to a computation that consumed it; keep a "
                   "copy (or don't donate it) if you need it again.")


class ShardState(enum.Enum):
    """Where a shard is in its life, as the controller knows it."""

    __hash__ = object.__hash__  # members are singletons: sets and tables hash them fast

    PENDING = "pending"  # an operation that defines the group is outstanding (host data to come)
    # Reads may go out: its worker was told how to make the bytes, or the operation that
    # tells it is ahead of every reader in the dispatch order (a program's outputs).
    DEFINED = "defined"
    STORED = "stored"  # its worker confirmed the bytes stored (a put's answer): ready
    FAILED = "failed"  # it will never hold bytes; uses report its reason
    DELETED = "deleted"  # deleted by the client or consumed by a donation; still on the worker
    FREED = "freed"  # dropped on its worker; nothing follows


S = ShardState
# The members as module constants: hot paths compare with these (an Enum class's attribute
# lookup costs several times a global's).
PENDING, DEFINED, STORED = S.PENDING, S.DEFINED, S.STORED
FAILED, DELETED, FREED = S.FAILED, S.DELETED, S.FREED
# state -> the states it may move to. Nothing leaves FREED; nothing goes back to PENDING.
LEGAL: dict[ShardState, frozenset[ShardState]] = {
    S.PENDING: frozenset({S.DEFINED, S.STORED, S.FAILED, S.DELETED, S.FREED}),
    S.DEFINED: frozenset({S.STORED, S.FAILED, S.DELETED, S.FREED}),
    S.STORED: frozenset({S.FAILED, S.DELETED, S.FREED}),
    S.FAILED: frozenset({S.DELETED, S.FREED}),
    S.DELETED: frozenset({S.FREED}),
    S.FREED: frozenset(),
}
GONE = frozenset({S.DELETED, S.FREED})  # no array may use the shard's bytes any more
HOLDING = frozenset({S.PENDING, S.DEFINED, S.STORED})  # holds bytes, or may come to


class IllegalTransition(errors.InternalError):
    """A shard or an array was asked to move to a state its own does not lead to: a bug in
    isthmus's bookkeeping (the move is refused, nothing changes)."""


def check_move(old: ShardState, new: ShardState, where: str) -> None:
    if new not in LEGAL[old]:
        raise IllegalTransition(
            f"{where}: a shard cannot go from {old.value} to {new.value}; this is a bug in "
            "isthmus: please report it.")


class Beside:
    """What the controller keeps next to a group's record and is not its state: futures, and
    the timing and readahead of a program's output (`BufferGroup.beside`)."""

    __slots__ = ("definers", "until_defined", "unanswered", "storing", "dispatched", "ahead")

    def __init__(self) -> None:
        # Operations that will define the group, still outstanding; `until_defined` is resolved
        # once the last settles (None: none outstanding).
        self.definers = 0
        self.until_defined: asyncio.Future[None] | None = None
        # Puts that defined the group before their answers came; `storing` is resolved once
        # those answers are recorded (None: none outstanding). A readiness wait waits on it,
        # asking nothing.
        self.unanswered = 0
        self.storing: asyncio.Future[None] | None = None
        # A program's output: [perf_counter() at its dispatch], shared by its outputs, until
        # a client's wait times it (`counts.Counts.waited`); None otherwise.
        self.dispatched: list[float] | None = None
        # The values of a small output's shards read ahead for the client (position ->
        # answer); controller/readahead.py.
        self.ahead: dict[int, asyncio.Future[np.ndarray]] | None = None


class BufferGroup:
    """The shard buffers of one allocation; position p is buffer `base + p` on `devices[p]`.

    `state` is every shard's state except those in `states_apart`; `reason` is every shard's
    reason for failing except those in `_reasons`. Both dictionaries stay None in the common
    case, where the shards of a group move together. `beside`: what is kept next to the
    record (`Beside`), or None.
    """

    __slots__ = ("base", "devices", "workers", "nbytes", "memory_kind", "state", "states_apart",
                 "reason", "_reasons", "refs", "shard_refs", "pins", "free_when_unpinned",
                 "origin", "beside", "log")

    def __init__(self, base: int, devices: tuple[Device, ...], workers: tuple[WorkerId, ...],
                 nbytes: tuple[int, ...], memory_kind: str | None = None,
                 definers: int = 0, log: Transitions | None = None) -> None:
        self.base = base
        self.devices = devices
        self.workers = workers  # the distinct workers of `devices`: where group commands go
        self.nbytes = nbytes  # per position
        self.memory_kind = memory_kind
        self.state = PENDING if definers else DEFINED
        # Position -> its own state, for the shards whose state is not `state`; None while
        # they all share it (the common case, which callers on hot paths test first).
        self.states_apart: dict[int, ShardState] | None = None
        self.reason: errors.IsthmusError | None = None  # every shard's, as far as known
        self._reasons: dict[int, errors.IsthmusError] | None = None  # position -> its own
        self.refs = 0  # arrays holding every shard
        self.shard_refs: dict[int, int] | None = None  # position -> arrays holding just it
        self.pins: dict[int, int] | None = None  # position -> moves still reading it
        self.free_when_unpinned: set[int] | None = None  # released while pinned
        # A small program output's origin: its executable's `readahead` table and the
        # output's index (controller/readahead.py); None otherwise.
        self.origin: tuple[dict[tuple[int, int], int], int] | None = None
        self.beside: Beside | None = None
        if definers:
            beside = self.beside = Beside()
            beside.definers = definers
            beside.until_defined = asyncio.get_running_loop().create_future()
        # Where its moves are recorded with their cause (the ledger's; None: nowhere).
        self.log = log
        if log is not None:
            log.record(base, len(devices), None, None, self.state)

    def aside(self) -> Beside:
        """What is kept next to the record, made now if it is not yet."""
        beside = self.beside
        if beside is None:
            beside = self.beside = Beside()
        return beside

    @property
    def until_defined(self) -> asyncio.Future[None] | None:
        """Resolved once every definer has settled (None: no definer is outstanding)."""
        beside = self.beside
        return None if beside is None else beside.until_defined

    @property
    def storing(self) -> asyncio.Future[None] | None:
        """Resolved once the answers of the puts that defined the group are recorded (None:
        none outstanding)."""
        beside = self.beside
        return None if beside is None else beside.storing

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"BufferGroup({self.base}, {len(self.devices)} shards, {self.state.value})"

    @property
    def ids(self) -> range:
        return range(self.base, self.base + len(self.devices))

    # ---- reading the state ---------------------------------------------------------------

    def state_at(self, position: int) -> ShardState:
        if self.states_apart is not None:
            own = self.states_apart.get(position)
            if own is not None:
                return own
        return self.state

    def states(self) -> set[ShardState]:
        """The states its shards are in (each once)."""
        if self.states_apart is None:
            return {self.state}
        found = set(self.states_apart.values())
        if len(self.states_apart) < len(self.devices):
            found.add(self.state)
        return found

    def positions_in(self, *states: ShardState) -> list[int]:
        return [p for p in range(len(self.devices)) if self.state_at(p) in states]

    def any_in(self, *states: ShardState) -> bool:
        if self.states_apart is None:
            return self.state in states
        return not self.states().isdisjoint(states)

    def all_in(self, *states: ShardState) -> bool:
        if self.states_apart is None:  # the common case, on every program's path: no set made
            return self.state in states
        return self.states() <= set(states)

    def reason_at(self, position: int) -> errors.IsthmusError | None:
        if self._reasons is not None and position in self._reasons:
            return self._reasons[position]
        return self.reason

    def first_reason(self) -> errors.IsthmusError | None:
        """The group's reason, or its first shard's own, or None."""
        if self.reason is not None:
            return self.reason
        if self._reasons:
            return self._reasons[min(self._reasons)]
        return None

    def gone_at(self, position: int) -> bool:
        """The shard's bytes may not be used: deleted, or freed after its deletion (a shard
        freed with a reason reports the reason instead)."""
        state = self.state_at(position)
        return state is DELETED or (state is FREED and self.reason_at(position) is None)

    def problem_at(self, position: int) -> errors.IsthmusError | None:
        """The error a use of the shard would meet, or None."""
        reason = self.reason_at(position)
        if reason is not None:
            return reason
        if self.gone_at(position):
            return errors.ArrayDeleted(DELETED_MESSAGE)
        return None

    def first_problem(self) -> errors.IsthmusError | None:
        """The error a use of the whole group would meet, or None."""
        reason = self.first_reason()
        if reason is not None:
            return reason
        if self.states_apart is None:  # no shard has a reason here: gone means deleted
            state = self.state
            return (errors.ArrayDeleted(DELETED_MESSAGE) if state is DELETED or state is FREED
                    else None)
        if self.any_in(*GONE) and any(self.gone_at(p) for p in range(len(self.devices))):
            return errors.ArrayDeleted(DELETED_MESSAGE)
        return None

    def held(self, position: int) -> bool:
        """Some array still holds the shard at `position`."""
        return self.refs > 0 or bool(self.shard_refs and self.shard_refs.get(position, 0) > 0)

    def pinned(self, position: int) -> bool:
        return bool(self.pins and self.pins.get(position))

    @property
    def all_stored(self) -> bool:
        """Every shard is host data its worker confirmed stored and ready."""
        return self.all_in(STORED)

    # ---- transitions ---------------------------------------------------------------------

    def _move(self, positions: Iterable[int], new: ShardState) -> None:
        """Moves the shards at `positions` to `new`, each checked first (all or none)."""
        positions = list(positions)
        for p in positions:
            check_move(self.state_at(p), new, repr(self))
        if self.log is not None:
            olds = {self.state_at(p) for p in positions}
            self.log.record(self.base, len(self.devices), tuple(positions),
                            olds.pop() if len(olds) == 1 else "mixed", new)
        if len(positions) == len(self.devices):
            self.state, self.states_apart = new, None
            return
        if self.states_apart is None:
            self.states_apart = {}
        for p in positions:
            self.states_apart[p] = new
        if (len(self.states_apart) == len(self.devices)
                and len(set(self.states_apart.values())) == 1):
            self.state, self.states_apart = new, None  # the shards move together again

    def _move_all(self, new: ShardState) -> None:
        if self.states_apart is None:
            if new not in LEGAL[self.state]:
                check_move(self.state, new, repr(self))
        else:
            for old in self.states():
                check_move(old, new, repr(self))
        if self.log is not None:
            self.log.record(self.base, len(self.devices), None,
                            self.state if self.states_apart is None else "mixed", new)
        self.state, self.states_apart = new, None

    def expect(self, count: int = 1) -> None:
        """`count` more operations will define the group; reads wait until they settle.
        Only a group still being defined (a definer outstanding) takes more."""
        beside = self.beside
        if beside is None or beside.definers <= 0:
            raise IllegalTransition(
                f"{self!r}: a group cannot expect definers once its shards have moved on "
                "from pending; this is a bug in isthmus: please report it.")
        beside.definers += count

    def settle(self, count: int = 1) -> None:
        """`count` definers are over; with the last, the pending shards become defined."""
        beside = self.beside
        definers = 0 if beside is None else beside.definers
        if definers < count:
            raise IllegalTransition(
                f"{self!r}: {count} definer(s) settled but {definers} were expected; "
                "this is a bug in isthmus: please report it.")
        assert beside is not None
        beside.definers -= count
        if beside.definers:
            return
        if self.states_apart is None:
            if self.state is PENDING:
                self.state = DEFINED  # PENDING -> DEFINED is legal: no check to make
                if self.log is not None:
                    self.log.record(self.base, len(self.devices), None, PENDING, DEFINED)
        else:
            pending = self.positions_in(PENDING)
            if pending:
                self._move(pending, DEFINED)
        if beside.until_defined is not None:
            if not beside.until_defined.done():
                beside.until_defined.set_result(None)
            beside.until_defined = None

    def stored(self, position: int) -> None:
        """Its worker confirmed the host data at `position` stored. A shard that failed,
        was deleted or freed meanwhile keeps its state (the answer came too late to matter)."""
        if self.state_at(position) in (PENDING, DEFINED):
            self._move((position,), STORED)
        elif self.state_at(position) is STORED:
            raise IllegalTransition(f"{self!r}: position {position} was stored twice; this "
                                    "is a bug in isthmus: please report it.")

    def expect_answers(self) -> None:
        """Puts whose answers the group will not wait for were sent (`answered` follows)."""
        beside = self.aside()
        if beside.storing is None:
            beside.storing = asyncio.get_running_loop().create_future()
        beside.unanswered += 1

    def answered(self) -> None:
        beside = self.beside
        if beside is None or beside.unanswered <= 0:
            raise IllegalTransition(f"{self!r}: a put's answer came that none expected; "
                                    "this is a bug in isthmus: please report it.")
        beside.unanswered -= 1
        if beside.unanswered == 0 and beside.storing is not None:
            if not beside.storing.done():
                beside.storing.set_result(None)
            beside.storing = None

    def fail(self, positions: Iterable[int] | None, reason: errors.IsthmusError) -> None:
        """The shards at `positions` (None: every shard) will never hold bytes; a shard that
        failed already keeps its first reason, and one deleted or freed keeps its state."""
        if positions is None:
            if self.reason is None and not self._reasons and self.all_in(*HOLDING):
                self._move_all(FAILED)
                self.reason = reason
                return
            positions = range(len(self.devices))
        moving = [p for p in positions if self.state_at(p) in HOLDING]
        if not moving:
            return
        self._move(moving, FAILED)
        if self._reasons is None:
            self._reasons = {}
        for p in moving:
            self._reasons[p] = reason

    def delete(self, positions: Iterable[int] | None = None) -> None:
        """The client deleted the shards, or a program consumed them. Those already deleted
        or freed stay as they are (a delete is idempotent)."""
        if positions is None:
            if not self.any_in(*GONE):
                self._move_all(DELETED)
                return
            positions = range(len(self.devices))
        moving = [p for p in positions if self.state_at(p) not in GONE]
        if moving:
            self._move(moving, DELETED)

    def free(self, positions: Iterable[int] | None = None) -> None:
        """The shards were dropped on their workers (the ledger sends the Free)."""
        if positions is None:
            if self.states_apart is None and self.state is not FREED:
                if self.log is not None:
                    self.log.record(self.base, len(self.devices), None, self.state, FREED)
                self.state = FREED  # legal from every state but FREED
                return
            self._move_all(FREED)
        else:
            self._move(positions, FREED)

    def pin(self, position: int) -> None:
        """A move reads the shard from its dispatch to its last command: it is not freed
        before (`unpin`)."""
        if self.state_at(position) is FREED:
            raise IllegalTransition(f"{self!r}: position {position} was pinned after it was "
                                    "freed; this is a bug in isthmus: please report it.")
        if self.pins is None:
            self.pins = {}
        self.pins[position] = self.pins.get(position, 0) + 1

    def unpin(self, position: int) -> bool:
        """One move less reads the shard; True when it was released meanwhile and may now
        be freed."""
        count = self.pins.get(position, 0) if self.pins else 0
        if count <= 0:
            raise IllegalTransition(f"{self!r}: position {position} was unpinned more often "
                                    "than pinned; this is a bug in isthmus: please report it.")
        assert self.pins is not None
        if count > 1:
            self.pins[position] = count - 1
            return False
        del self.pins[position]
        if self.free_when_unpinned and position in self.free_when_unpinned:
            self.free_when_unpinned.discard(position)
            return True
        return False

    def defer_free(self, position: int) -> None:
        """The shard was released while a move reads it: freed at its last unpin."""
        if not self.pinned(position):
            raise IllegalTransition(f"{self!r}: position {position} was to be freed at its "
                                    "unpin but is not pinned; this is a bug in isthmus.")
        if self.free_when_unpinned is None:
            self.free_when_unpinned = set()
        self.free_when_unpinned.add(position)

    # ---- checking ------------------------------------------------------------------------

    def validate(self) -> None:
        """Raises AssertionError where the group's records disagree with each other. (Validate
        mode runs it for every group after every request: a message is made only on failure.)"""
        assert self.refs >= 0, f"{self!r}: refs {self.refs}"
        assert all(n >= 0 for n in (self.shard_refs or {}).values()), f"{self!r}: shard refs"
        states = self.states()
        beside = self.beside
        if beside is None:
            assert PENDING not in states, f"{self!r}: pending with no definer"
        else:
            assert beside.definers >= 0, f"{self!r}: definers {beside.definers}"
            assert (beside.definers > 0) == (beside.until_defined is not None), (
                f"{self!r}: {beside.definers} definers but until_defined "
                f"{beside.until_defined}")
            if beside.definers == 0:
                assert PENDING not in states, f"{self!r}: pending with no definer"
            assert (beside.unanswered > 0) == (beside.storing is not None), (
                f"{self!r}: answers")
        if self.states_apart is not None:
            assert self.states_apart, f"{self!r}: an empty exception table"
            assert len(self.states_apart) < len(self.devices) or len(set(
                self.states_apart.values())) > 1, f"{self!r}: exceptions that agree"
            assert all(0 <= p < len(self.devices) for p in self.states_apart), repr(self)
        for p, count in (self.pins or {}).items():
            assert count > 0, f"{self!r}: pin count {count} at {p}"
            assert self.state_at(p) is not FREED, f"{self!r}: freed while pinned at {p}"
        for p in self.free_when_unpinned or ():
            assert self.pinned(p), f"{self!r}: a deferred free at {p} without a pin"
        if self.reason is not None or self._reasons:
            for p in range(len(self.devices)):
                if self.state_at(p) is FAILED:
                    assert self.reason_at(p) is not None, f"{self!r}: failed without reason"
        elif FAILED in states:
            raise AssertionError(f"{self!r}: failed without a reason")
