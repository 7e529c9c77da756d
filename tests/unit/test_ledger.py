"""The ledger (controller/ledger.py, groups.py, arrays.py): every illegal transition of a shard
and of an array is refused and changes nothing; holding, releasing, deletion, donation, pins,
frees and failures keep the records consistent (`validate_state` after each step) and send
the frees they should, once."""

import asyncio
import itertools

import pytest

from isthmus import errors
from isthmus.controller.arrays import ARRAY_LEGAL, Array, ArrayState, Buffer
from isthmus.controller.groups import LEGAL, IllegalTransition, ShardState
from isthmus.controller.ledger import Ledger
from isthmus.controller.sharding import Sharding, ShardingKind
from tests.unit.fakes import DEVICES, F32, FakeFleet, hold_array

S = ShardState



def _ledger():
    fleet = FakeFleet()
    return Ledger(fleet), fleet


def _view(ledger, buffers):
    sharding = Sharding(ShardingKind.OPAQUE, tuple(b.device.id for b in buffers))
    return ledger.hold(Array(F32, (4 * len(buffers),), sharding, parts=tuple(buffers)))


def run(coroutine_function):
    """Runs a test body in an event loop (groups with definers make futures)."""
    return asyncio.run(coroutine_function())


# ---- every transition of the tables ---------------------------------------------------------

# How to bring position 0 of a fresh group (one definer outstanding) to each state, legally.
REACH = {
    S.PENDING: lambda g: None,
    S.DEFINED: lambda g: g.settle(),
    S.STORED: lambda g: g.stored(0),
    S.FAILED: lambda g: g.fail((0,), errors.InvalidRequest("bad")),
    S.DELETED: lambda g: g.delete((0,)),
    S.FREED: lambda g: g.free((0,)),
}
ILLEGAL = [(old, new) for old, new in itertools.product(S, S) if new not in LEGAL[old]]


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=lambda s: s.value)
def test_every_illegal_shard_transition_is_refused(old, new):
    async def body():
        ledger, _ = _ledger()
        group = ledger.new_group(DEVICES, (16,) * 4, definers=1)
        REACH[old](group)
        assert group.state_at(0) is old
        with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
            group._move((0,), new)
        assert group.state_at(0) is old
        before = [group.state_at(p) for p in range(4)]
        with pytest.raises(IllegalTransition):  # the whole group's move checks every shard
            group._move_all(new)
        assert [group.state_at(p) for p in range(4)] == before
    run(body)


# In a fixed order (LEGAL's values are sets): every pytest process collects the same list.
@pytest.mark.parametrize(("old", "new"),
                         [(o, n) for o in S for n in sorted(LEGAL[o], key=lambda s: s.value)],
                         ids=lambda s: s.value)
def test_every_legal_shard_transition_is_taken(old, new):
    async def body():
        ledger, _ = _ledger()
        group = ledger.new_group(DEVICES, (16,) * 4, definers=1)
        REACH[old](group)
        group._move((0,), new)
        assert group.state_at(0) is new
        assert group.state_at(1) in (S.PENDING, S.DEFINED)
    run(body)


ARRAY_ILLEGAL = [(old, new) for old, new in itertools.product(ArrayState, ArrayState)
                 if new not in ARRAY_LEGAL[old]]


@pytest.mark.parametrize(("old", "new"), ARRAY_ILLEGAL, ids=lambda s: s.value)
def test_every_illegal_array_transition_is_refused(old, new):
    ledger, _ = _ledger()
    array = hold_array(ledger)
    if old is not ArrayState.LIVE:
        array.move(old)
    with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
        array.move(new)
    assert array.state is old


# ---- the operations that refuse what cannot happen -------------------------------------------

def test_settle_without_a_definer_is_refused():
    ledger, _ = _ledger()
    group = hold_array(ledger).group
    with pytest.raises(IllegalTransition, match="0 were expected"):
        group.settle()
    ledger.validate_state()


def test_a_defined_group_takes_no_more_definers():
    async def body():
        ledger, _ = _ledger()
        group = hold_array(ledger).group
        with pytest.raises(IllegalTransition, match="cannot expect definers"):
            group.expect()
        assert group.until_defined is None
        ledger.validate_state()
    run(body)


def test_a_shard_stored_twice_is_refused_and_late_answers_change_nothing():
    async def body():
        ledger, _ = _ledger()
        array = hold_array(ledger, definers=1)
        group = array.group
        group.stored(0)
        with pytest.raises(IllegalTransition, match="stored twice"):
            group.stored(0)
        group.fail((1,), errors.InvalidRequest("bad data"))
        group.delete((2,))
        group.stored(1)  # answers that come after a failure or a delete are too late
        group.stored(2)
        group.settle()
        assert [group.state_at(p) for p in range(4)] == [S.STORED, S.FAILED, S.DELETED,
                                                         S.DEFINED]
        ledger.validate_state()
    run(body)


def test_pins_are_counted_and_refused_when_wrong():
    ledger, _ = _ledger()
    array = hold_array(ledger)
    buffer = array.shards[0]
    with pytest.raises(IllegalTransition, match="unpinned more often"):
        ledger.unpin(buffer)
    with pytest.raises(IllegalTransition, match="not pinned"):
        array.group.defer_free(0)
    ledger.free_groups([array.group])
    with pytest.raises(IllegalTransition, match="pinned after it was freed"):
        ledger.pin(buffer)


def test_an_unexpected_put_answer_is_refused():
    ledger, _ = _ledger()
    with pytest.raises(IllegalTransition, match="none expected"):
        hold_array(ledger).group.answered()


def test_an_array_held_twice_is_refused():
    ledger, _ = _ledger()
    array = hold_array(ledger)
    with pytest.raises(errors.InternalError, match="held twice"):
        ledger.hold(array)
    ledger.validate_state()


# ---- lives of arrays, checked after each step ---------------------------------------------

def test_definition_and_readiness():
    async def body():
        ledger, _ = _ledger()
        array = hold_array(ledger, definers=2)
        group = array.group
        ledger.validate_state()
        assert group.states() == {S.PENDING} and group.until_defined is not None
        group.stored(1)
        ledger.validate_state()
        group.settle()
        ledger.validate_state()
        assert group.state_at(0) is S.PENDING
        group.settle()
        ledger.validate_state()
        assert group.until_defined is None
        assert [group.state_at(p) for p in range(4)] == [S.DEFINED, S.STORED, S.DEFINED,
                                                         S.DEFINED]
        for p in (0, 2, 3):
            group.stored(p)
            ledger.validate_state()
        assert group.all_stored and group.states() == {S.STORED}
        assert group.states_apart is None  # the shards move together again: one record
        group.expect_answers()
        ledger.validate_state()
        group.answered()
        ledger.validate_state()
    run(body)


def test_release_frees_only_what_no_array_holds():
    ledger, fleet = _ledger()
    a = hold_array(ledger)
    view = _view(ledger, a.shards[1:3])
    ledger.validate_state()
    groups, buffers = ledger.release([a])
    ledger.validate_state()
    assert groups == [] and [b.position for b in buffers] == [0, 3]
    ledger.free_groups(groups)
    ledger.free_buffers(buffers)
    ledger.validate_state()
    assert fleet.freed() == {a.group.base, a.group.base + 3}
    assert ledger.release([a]) == ([], [])  # released once only
    groups, buffers = ledger.release([view])
    ledger.free_buffers(buffers)
    ledger.validate_state()
    assert fleet.freed() == set(a.group.ids)
    assert ledger.accounting() == {0: {"buffers": 0, "bytes": 0}, 1: {"buffers": 0, "bytes": 0}}
    assert ledger.live_groups() == []


def test_delete_frees_for_every_sharer_in_dispatch_order():
    ledger, fleet = _ledger()
    a = hold_array(ledger)
    view = _view(ledger, a.shards[:2])
    ledger.request_delete(a)
    ledger.validate_state()
    assert a.is_deleted and a.state is ArrayState.DELETING
    assert a.problem() is None  # operations dispatched before the delete still use it
    assert not view.is_deleted
    ledger.delete([a])
    ledger.validate_state()
    assert a.state is ArrayState.DELETED and a.group.states() == {S.FREED}
    assert fleet.freed() == set(a.group.ids)
    assert view.is_deleted
    assert isinstance(view.problem(), errors.ArrayDeleted)
    ledger.delete([a])  # deleted already: nothing more is freed
    ledger.validate_state()
    for array in (a, view):
        ledger.free_buffers(ledger.release([array])[1])
        ledger.validate_state()
    assert fleet.freed() == set(a.group.ids)


def test_a_donated_view_source_owns_nothing_and_its_delete_frees_nothing():
    ledger, fleet = _ledger()
    a = hold_array(ledger)
    view = _view(ledger, a.shards[:2])
    ledger.request_delete(view)
    ledger.donate(view)
    ledger.validate_state()
    assert isinstance(view.problem(), errors.ArrayDeleted)
    ledger.delete([view])
    ledger.validate_state()
    assert fleet.freed() == set() and a.problem() is None


def test_consumed_by_a_program_then_released():
    ledger, fleet = _ledger()
    a = hold_array(ledger)
    ledger.consume(a)
    ledger.validate_state()
    assert a.group.states() == {S.DELETED} and fleet.freed() == set()
    assert isinstance(a.problem(), errors.ArrayDeleted)
    groups, buffers = ledger.release([a])
    ledger.free_groups(groups)
    ledger.validate_state()
    assert fleet.freed() == set(a.group.ids)


def test_a_pinned_source_is_freed_at_its_last_unpin():
    ledger, fleet = _ledger()
    a = hold_array(ledger)
    source = a.shards[2]
    ledger.pin(source)
    ledger.pin(source)
    ledger.validate_state()
    groups, buffers = ledger.release([a])
    ledger.free_groups(groups)
    ledger.validate_state()
    assert fleet.freed() == set(a.group.ids) - {source.id}
    assert a.group.state_at(2) is S.DEFINED and ledger.live_groups() == [a.group]
    ledger.unpin(source)
    ledger.validate_state()
    assert source.id not in fleet.freed()
    ledger.unpin(source)
    ledger.validate_state()
    assert fleet.freed() == set(a.group.ids) and ledger.live_groups() == []


def test_a_lost_slice_fails_its_shards_and_an_evicted_one_frees_them():
    ledger, fleet = _ledger()
    a, b = hold_array(ledger), hold_array(ledger)
    ledger.consume(b)
    lost = errors.WorkerLost("slice 0 was lost")
    ledger.poison_slice(0, lost)
    ledger.validate_state()
    assert [a.group.state_at(p) for p in range(4)] == [S.FAILED, S.FAILED, S.DEFINED,
                                                       S.DEFINED]
    assert a.problem() is lost and not a.is_deleted
    assert b.group.states() == {S.DELETED}  # deleted first: it stays deleted
    taken = errors.WorkerLost("slice 1 was taken")
    ledger.evict_slice(1, taken)
    ledger.validate_state()
    assert a.group.state_at(3) is S.FREED and a.shards[3].problem() is taken
    assert not a.is_deleted
    assert fleet.freed() == {a.group.base + 2, a.group.base + 3, b.group.base + 2,
                             b.group.base + 3}


def test_validate_state_finds_records_that_disagree():
    ledger, _ = _ledger()
    a = hold_array(ledger)
    a.group.refs += 1
    with pytest.raises(AssertionError, match="refs 2, held by 1"):
        ledger.validate_state()
    a.group.refs -= 1
    a.group.state = S.FAILED  # failed, but nobody said why
    with pytest.raises(AssertionError, match="without a reason"):
        ledger.validate_state()
    a.group.state = S.DEFINED
    ledger.validate_state()
    buffer = Buffer(a.group, 1)
    ledger.pin(buffer)
    a.group.states_apart = {1: S.FREED}
    with pytest.raises(AssertionError, match="freed while pinned"):
        ledger.validate_state()


def test_validate_state_finds_a_freed_group_listed_a_pending_one_and_shard_counts():
    ledger, _ = _ledger()
    a, b = hold_array(ledger), hold_array(ledger)
    a.group.state = S.FREED  # every shard freed, still listed as live
    with pytest.raises(AssertionError, match="freed but still live"):
        ledger.validate_state()
    a.group.state = S.PENDING  # pending, but no operation will define it
    a.group.beside = None
    with pytest.raises(AssertionError, match="pending with no definer"):
        ledger.validate_state()
    a.group.state = S.DEFINED
    b.group.shard_refs = {2: 1}  # a shard held by no array's parts
    with pytest.raises(AssertionError, match=r"shard refs \{2: 1\}, held by \{\}"):
        ledger.validate_state()
    b.group.shard_refs = {2: 0}  # zero counts are no holders
    ledger.validate_state()


def test_an_arrays_error_is_set_through_the_ledger_once():
    async def body():
        ledger, _ = _ledger()
        array = hold_array(ledger)
        ledger.poison(array, None)  # a clean source: nothing to carry along
        assert array.error is None
        ledger.poison(array, errors.WorkerLost("worker 1 was lost"))
        assert array.problem().message == "worker 1 was lost"
        with pytest.raises(errors.InternalError, match="poisoned again"):
            ledger.poison(array, errors.InvalidRequest("bad"))
        assert array.error.message == "worker 1 was lost"
        ledger.validate_state()

    run(body)


def test_groups_freed_together_go_out_as_one_range_when_their_ids_follow_one_another():
    """A step's outputs freed together (ids that follow one another, in any order) are one
    range on the wire; groups apart are each id, every id once."""
    ledger = Ledger(FakeFleet())
    groups = [ledger.new_group(DEVICES, (16,) * 4) for _ in range(3)]
    ledger.free_groups([groups[2], groups[0], groups[1]])
    [(workers, free)] = ledger.fleet.sent
    assert workers == (0, 1) and free.buffers == range(groups[0].base, groups[2].base + 4)
    apart = [ledger.new_group(DEVICES, (16,) * 4) for _ in range(3)]
    ledger.free_groups([apart[2], apart[0]])
    [(_, free)] = ledger.fleet.sent[1:]
    assert sorted(free.buffers) == [*apart[0].ids, *apart[2].ids]
    assert len(set(free.buffers)) == len(free.buffers)
    ledger.validate_state()
