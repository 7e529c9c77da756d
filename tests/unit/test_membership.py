"""A worker's membership (`worker/membership.py`): every phase and event, the moves they
allow, and the races of a group re-forming behind commands still being applied."""

import asyncio
import itertools

import pytest

from isthmus.transport import messages as m
from isthmus.worker import membership as ms
from isthmus.worker.membership import (
    ACTIVE,
    EVENTS,
    MOVES,
    Failed,
    GroupActive,
    GroupCalled,
    IllegalMove,
    Membership,
    Phase,
    Refused,
    Stop,
    StreamEnded,
    Welcomed,
)

P = Phase
SAMPLE = {Welcomed: Welcomed(), Refused: Refused(), GroupCalled: GroupCalled(0),
          GroupActive: GroupActive(0), StreamEnded: StreamEnded(), Stop: Stop(),
          Failed: Failed("a bug")}


def _at(phase: Phase) -> Membership:
    """A membership brought to `phase` by the events that lead there."""
    membership = Membership()
    path = {P.REGISTERING: [], P.JOINED: [Welcomed()],
            P.FORMING: [Welcomed(), GroupCalled(0)],
            P.IN_GROUP: [Welcomed(), GroupCalled(0), GroupActive(0)],
            P.STOPPING: [Welcomed(), Stop()], P.ENDED: [Refused()]}[phase]
    for event in path:
        membership.handle(event)
    assert membership.phase is phase
    return membership


def test_every_phase_has_its_moves_and_only_ended_is_final():
    assert set(MOVES) == set(P)
    assert {p for p, to in MOVES.items() if not to} == {P.ENDED}
    assert all(P.ENDED in to for p, to in MOVES.items() if p is not P.ENDED)
    assert ACTIVE == {P.REGISTERING, P.JOINED, P.FORMING, P.IN_GROUP}
    assert set(EVENTS) == set(SAMPLE)


@pytest.mark.parametrize("phase,event", list(itertools.product(P, EVENTS)))
def test_each_event_in_each_phase_moves_along_moves_or_is_refused_unchanged(phase, event):
    membership = _at(phase)
    before = (membership.phase, membership.exit_code, membership.superseded.is_set())
    if phase not in event.phases:
        with pytest.raises(IllegalMove, match="bug in isthmus"):
            membership.handle(SAMPLE[event])
        assert (membership.phase, membership.exit_code,
                membership.superseded.is_set()) == before
        return
    membership.handle(SAMPLE[event])
    assert membership.phase is phase or membership.phase in MOVES[phase]


def test_a_group_re_forming_behind_the_one_being_activated_keeps_it_superseded():
    membership = _at(P.IN_GROUP)
    membership.handle(GroupCalled(1, frozenset({3}), "worker 1 was lost"))
    assert membership.phase is P.FORMING and membership.superseded.is_set()
    assert membership.gone == {3} and membership.loss_reason() == "worker 1 was lost"
    # A second FormGroup is read while the first group's DeviceMap is still being applied:
    # the group made active is already on its way out.
    membership.handle(GroupCalled(2, frozenset({3, 4}), "worker 2 was lost"))
    membership.handle(GroupActive(1))
    assert membership.phase is P.FORMING and membership.superseded.is_set()
    assert membership.generation == 1 and membership.gone == {3, 4}
    membership.handle(GroupActive(2))
    assert membership.phase is P.IN_GROUP and not membership.superseded.is_set()
    # Its reason stays the answer for a while after the group formed.
    assert membership.loss_reason() == "worker 2 was lost"


def test_a_loss_reason_is_forgotten_after_a_while(monkeypatch):
    membership = _at(P.IN_GROUP)
    membership.handle(GroupCalled(1, reason="worker 1 was lost"))
    membership.handle(GroupActive(1))
    reason, at = membership.last_loss
    membership.last_loss = (reason, at - ms.LOSS_REASON_KEPT - 1)
    assert membership.loss_reason() == ""


def test_the_stream_ending_registers_afresh_and_forgets_the_group():
    membership = _at(P.FORMING)
    membership.count(5)
    membership.handle(StreamEnded())
    assert membership.phase is P.REGISTERING and membership.active
    assert not membership.superseded.is_set() and membership.gone == frozenset()
    assert membership.generation == membership.called == -1
    membership.handle(Welcomed())
    assert membership.applied == membership.acked == 0  # counted anew per membership


def test_a_used_join_token_ends_it_and_a_refusal_ends_it_with_its_code():
    membership = _at(P.IN_GROUP)
    membership.handle(StreamEnded(reusable=False))
    assert membership.phase is P.ENDED and membership.exit_code == ms.EXIT_CONTROLLER_LOST
    fresh = Membership()  # never welcomed: a join token not yet used may register again
    fresh.handle(StreamEnded(reusable=False))
    assert fresh.phase is P.REGISTERING
    fresh.handle(Refused(ms.EXIT_REFUSED))
    assert fresh.phase is P.ENDED and fresh.exit_code == ms.EXIT_REFUSED
    assert fresh.ending.is_set()


def test_a_stop_keeps_its_code_through_the_end_and_wakes_the_wait():
    async def main():
        membership = _at(P.IN_GROUP)
        waiting = asyncio.ensure_future(membership.ending.wait())
        await asyncio.sleep(0)
        assert not waiting.done()
        membership.handle(Stop(ms.EXIT_SHUTDOWN))
        await asyncio.wait_for(waiting, 1)
        membership.handle(GroupCalled(3))  # read while stopping: recorded, no move
        assert membership.phase is P.STOPPING and membership.superseded.is_set()
        membership.handle(StreamEnded())
        assert membership.phase is P.ENDED and membership.exit_code == ms.EXIT_SHUTDOWN
        membership.handle(Stop(7))  # a late signal changes nothing
        assert membership.exit_code == ms.EXIT_SHUTDOWN

    asyncio.run(main())


def test_acknowledgements_every_ack_every_and_heartbeats_between():
    membership = _at(P.IN_GROUP)
    acks = [membership.count(1) for _ in range(m.ACK_EVERY * 2)]
    sent = [a for a in acks if a is not None]
    assert [a.total for a in sent] == [m.ACK_EVERY, 2 * m.ACK_EVERY]
    membership.count(3)
    assert membership.acknowledge() == 2 * m.ACK_EVERY + 3
    assert membership.count(m.ACK_EVERY - 1) is None


def test_a_failed_loop_tells_the_controller_why():
    membership = _at(P.IN_GROUP)
    [leaving] = membership.handle(Failed("it left the fleet: a bug"))
    assert isinstance(leaving, m.Leaving) and "a bug" in leaving.reason
    assert membership.phase is P.IN_GROUP  # the stream's end moves it on
