"""The ledger's log of moves (controller/transitions.py): each move of a shard is recorded
with its cause (the request being handled, or the fleet event), the log is bounded, and
`of` finds one buffer's moves, whole-group moves and its own position's alike."""

import asyncio

import pytest

from isthmus import errors
from isthmus.controller.ledger import Ledger
from isthmus.controller.transitions import Transitions, describe
from tests.unit.fakes import DEVICES, F32, FakeFleet, hold_array


def _moves(ledger, buffer_id):
    return [(e["old"], e["new"], e["positions"], e["cause"])
            for e in ledger.transitions.of(buffer_id)]


def test_every_move_of_a_buffer_is_kept_with_the_request_that_caused_it():
    async def body():
        ledger = Ledger(FakeFleet())
        log = ledger.transitions
        log.cause = ("make_array_from_host_buffer_request", 7, 1)
        array = hold_array(ledger, definers=1)
        group = array.group
        group.settle()
        group.stored(1)
        log.cause = None  # the put's answer for position 2 arrives outside a request
        group.stored(2)
        log.cause = ("delete_array_request", 9, 1)
        ledger.request_delete(array)
        ledger.delete([array])
        log.cause = None
        base = group.base
        put = "make_array_from_host_buffer_request (op 7) of session 1"
        assert _moves(ledger, base + 1) == [
            (None, "pending", None, put), ("pending", "defined", None, put),
            ("defined", "stored", [1], put),
            ("mixed", "deleted", None, "delete_array_request (op 9) of session 1"),
            ("deleted", "freed", None, "delete_array_request (op 9) of session 1")]
        # Position 2's answer came later; position 0's never did.
        assert [m[:2] for m in _moves(ledger, base + 2)][2] == ("defined", "stored")
        assert _moves(ledger, base + 2)[2][3] == describe(None)
        assert [m[:2] for m in _moves(ledger, base)] == [
            (None, "pending"), ("pending", "defined"), ("mixed", "deleted"),
            ("deleted", "freed")]
        assert ledger.state_of(base) == "freed" and _moves(ledger, base + 4) == []

    asyncio.run(body())


def test_a_slice_lost_names_itself_as_the_cause():
    async def body():
        ledger = Ledger(FakeFleet())
        array = hold_array(ledger)
        ledger.transitions.cause = ("loaded_executable_execute_request", 3, 2)
        ledger.poison_slice(1, errors.WorkerLost("worker 1 was lost"))
        assert ledger.transitions.cause == ("loaded_executable_execute_request", 3, 2)
        [_, failed] = ledger.transitions.of(array.group.base + 2)
        assert (failed["old"], failed["new"], failed["positions"], failed["cause"]) == (
            "defined", "failed", [2, 3], "slice 1 lost")
        [made] = ledger.transitions.of(array.group.base)  # slice 0's shards did not move
        assert made["old"] is None and made["new"] == "defined"
        assert ledger.state_of(array.group.base + 2) == "failed"
        assert ledger.state_of(array.group.base) == "defined"

    asyncio.run(body())


def test_the_log_keeps_its_last_moves_only_and_none_when_off():
    async def body():
        ledger = Ledger(FakeFleet(), history=5)
        arrays = [hold_array(ledger, DEVICES[:1]) for _ in range(4)]
        assert len(ledger.transitions) == 4
        for array in arrays:
            ledger.request_delete(array)
            ledger.delete([array])
        assert len(ledger.transitions) == 5  # 12 moves, the last 5 kept
        assert ledger.transitions.of(arrays[0].group.base) == []
        assert [e["new"] for e in ledger.transitions.of(arrays[3].group.base)] == [
            "deleted", "freed"]
        off = Ledger(FakeFleet(), history=0)
        array = hold_array(off)
        off.request_delete(array)
        off.delete([array])
        assert len(off.transitions) == 0 and array.group.log is None

    asyncio.run(body())


def test_a_runs_groups_made_consumed_and_freed_together_read_as_one_by_one():
    """A program run's outputs made in one call (`new_groups`), its donated arguments
    consumed in one (`consume_all`) and a step's arrays freed in one (`free_groups`) log one
    entry per adjacent run of groups: `of` finds each buffer's moves as it does when every
    group logs its own, and the states and frees sent are the same."""
    from isthmus.controller.arrays import Array
    from isthmus.controller.groups import FREED
    from isthmus.controller.sharding import Sharding, ShardingKind

    def hold(ledger, group):
        sharding = Sharding(ShardingKind.OPAQUE, tuple(d.id for d in DEVICES))
        return ledger.hold(Array(F32, (16,), sharding, group))

    async def body():
        batched, single = Ledger(FakeFleet()), Ledger(FakeFleet())
        for ledger in (batched, single):
            ledger.transitions.cause = ("loaded_executable_execute_request", 5, 1)
        shapes = [((16,) * 4, None)] * 3
        made = [hold(batched, g) for g in batched.new_groups(DEVICES, shapes, (0, 1))]
        alone = [hold(single, single.new_group(DEVICES, n, k, (0, 1))) for n, k in shapes]
        done = hold_array(batched)  # deleted before the run: consumed the long way, unchanged
        batched.request_delete(done)
        batched.delete([done])
        assert len(batched.transitions) == 1 + 3  # the run's making is one entry
        batched.request_delete(made[0])
        batched.consume_all([made[0], made[2], made[1]])  # not in id order
        for array in alone:
            single.consume(array)
        batched.free_groups([a.group for a in made])
        single.free_groups([a.group for a in alone])
        for array, twin in zip(made, alone):
            assert array.state is twin.state and array.group.state is FREED
            for p in range(4):
                assert _moves(batched, array.group.base + p) == _moves(single,
                                                                        twin.group.base + p)
        assert [c for _, c in batched.fleet.sent[1:]] == [c for _, c in single.fleet.sent]
        with pytest.raises(errors.InternalError, match="deleted to deleted"):
            batched.consume_all([made[0]])  # twice: refused as consume refuses it
        batched.validate_state()

    asyncio.run(body())


def test_describe_names_requests_events_and_their_absence():
    assert describe(("compile_request", 4, 9)) == "compile_request (op 4) of session 9"
    assert describe("slice 2 lost") == "slice 2 lost"
    assert "no request" in describe(None)
    log = Transitions(0)  # a deque needs room for one: the ledger gives groups no log then
    log.record(1, 1, None, None, "defined")
    assert len(log) == 1
