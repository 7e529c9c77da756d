"""Moves, donation and deletion through a controller `Session`, with the ledger's
`validate_state()` after each step: a move's sources stay pinned until its last command, a
donated array is gone while its shards live on where they should, a delete acts in dispatch
order and frees each shard once. Driven in-process over the real worker channel with streams
that keep their frames (tests/unit/fakes.py's `Host`); the answers of pulls are given
by the test, so it can act while a move is in flight."""

import asyncio

import numpy as np

from isthmus import dtypes, errors
from isthmus.controller.arrays import ArrayState
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.controller.groups import ShardState
from isthmus.controller.session import Session
from isthmus.controller.session_arrays import HostData
from isthmus.controller.sharding import Sharding, ShardingKind
from isthmus.transport import commands as c
from isthmus.transport.records import Aval, CompiledInfo, CompileRequest
from tests.unit.fakes import Host

F32 = dtypes.BY_KIND["KIND_F32"]
HOSTS = 3
IDS = tuple(range(HOSTS))


class PullingHost(Host):
    """A `Host` whose pulls wait for the test (`answer_pulls`), and that compiles a program
    donating its one argument."""

    def __init__(self, slot):
        super().__init__(slot)
        self.pulls = []

    def ask(self, request):
        if isinstance(request, c.Pull):
            future = asyncio.get_running_loop().create_future()
            self.pulls.append((request, future))
            return future
        if isinstance(request, c.Compile):
            aval = Aval(F32, (HOSTS,))
            return self._answer(CompiledInfo(
                name="p", params=(aval,), outputs=(aval,), param_shardings=None,
                output_shardings=None, param_layouts=("{0}",), output_layouts=("{0}",),
                output_memory_kinds=("device",), donated_inputs=(0,), fingerprint=None,
                memory_stats={}, generated_code_bytes=0))
        return super().ask(request)

    def answer_pulls(self):
        for _, future in self.pulls:
            if not future.done():
                future.set_result(None)


class Late:
    """Host data that arrives when the test says (`arrive`)."""

    def __init__(self):
        self.receivers = []

    def subscribe(self, receive):
        self.receivers.append(receive)

    def arrive(self, value):
        for receive in self.receivers:
            receive(value)


def _setup():
    hosts = {h: PullingHost(h) for h in range(HOSTS)}
    devices = [Device(h, h, 0, "cpu", "cpu", 0, h) for h in range(HOSTS)]
    controller = Controller(WholeFleet(devices, hosts))
    return hosts, controller, Session(controller)


def _frees(hosts):
    """Every buffer id freed on any host; each host is freed a buffer at most once."""
    freed = set()
    for host in hosts.values():
        ids = [i for x in host.commands() if isinstance(x, c.Free) for i in x.buffers]
        assert len(ids) == len(set(ids)), f"freed twice on a host: {ids}"
        freed.update(ids)
    return freed


def _array(session):
    return session.arrays.make_array(F32, (HOSTS,), Sharding(ShardingKind.HLO, IDS),
                                     HostData(np.arange(HOSTS, dtype=np.float32)))


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


async def _step(controller):
    """Lets the session's queued work run, then checks the ledger."""
    await asyncio.sleep(0.01)
    controller.fleet.flush()
    controller.ledger.validate_state()


def test_a_donated_argument_is_deleted_in_dispatch_order_and_freed_on_release():
    async def main():
        hosts, controller, session = _setup()
        check = controller.ledger.validate_state
        executable = session.programs.compile(CompileRequest(b"", b"", IDS))
        await executable.compiled
        x = _array(session)
        check()
        await _step(controller)
        (y,), _ = session.programs.execute(executable, [x])
        check()
        assert x.state is ArrayState.DELETED and x.group.states() == {ShardState.DELETED}
        assert isinstance(x.problem(), errors.ArrayDeleted) and y.problem() is None
        (z,), _ = session.programs.execute(executable, [x])  # a donated input again
        check()
        assert isinstance(z.problem(), errors.ArrayDeleted)
        session.arrays.release([x])
        await _step(controller)
        assert set(x.group.ids) <= _frees(hosts)
        assert x.group.states() == {ShardState.FREED}
        await session.close()
        await _step(controller)
        assert controller.ledger.live_groups() == []
    run(main())


def test_a_view_donation_leaves_the_shards_to_the_view_and_a_later_delete_frees_nothing():
    async def main():
        hosts, controller, session = _setup()
        check = controller.ledger.validate_state
        x = _array(session)
        await _step(controller)
        parts = session.views.disassemble(x, True)  # the queue is empty: it acts at once
        check()
        assert x.is_deleted and x.state is ArrayState.DELETED
        assert all(p.problem() is None for p in parts)
        await session.arrays.delete([x])
        await _step(controller)
        assert _frees(hosts) == set()  # x owns nothing any more
        assert all(p.problem() is None for p in parts)
        session.arrays.release([x, parts[0]])
        await _step(controller)
        assert _frees(hosts) == {x.group.base}
        await session.arrays.delete([parts[1]])
        await _step(controller)
        assert _frees(hosts) == {x.group.base, x.group.base + 1}
        assert isinstance(parts[1].problem(), errors.ArrayDeleted)
        await session.close()
        await _step(controller)
        assert _frees(hosts) == set(x.group.ids)
    run(main())


def test_a_delete_waits_behind_the_operations_asked_for_before_it():
    async def main():
        hosts, controller, session = _setup()
        check = controller.ledger.validate_state
        x = _array(session)
        await _step(controller)
        # A copy to another device pulls x's shard 1 worker to worker; x is deleted while
        # the pull is in flight: the shard stays pinned until the pull is over.
        (copy,) = session.moves.copy_arrays([session.views.disassemble(x)[1]], [0], None)
        check()
        late = Late()
        pending = session.arrays.make_array(F32, (HOSTS,), x.sharding, late)
        session.moves.copy_arrays([pending], [2, 0, 1], None)  # waits for its data
        deleting = session.arrays.delete([x])
        check()
        assert x.is_deleted and x.state is ArrayState.DELETING  # behind the waiting copy
        assert x.problem() is None  # what was asked for before the delete still reads x
        await _step(controller)
        assert x.state is ArrayState.DELETING and not deleting.done()
        late.arrive(np.zeros(HOSTS, np.float32))
        await _step(controller)
        await deleting
        assert x.state is ArrayState.DELETED
        check()
        source = x.group.base + 1
        assert source not in _frees(hosts)  # pinned by the pull
        assert x.group.state_at(1) is ShardState.DELETED and x.group.pinned(1)
        assert x.group.state_at(0) is ShardState.FREED
        assert copy.group.states() == {ShardState.PENDING}
        hosts[0].answer_pulls()
        await _step(controller)
        assert source in _frees(hosts)  # freed at the pull's last command
        assert copy.group.states() == {ShardState.DEFINED} and copy.problem() is None
        await session.close()
        await _step(controller)
        assert controller.ledger.live_groups() == []
    run(main())


def test_a_reshard_from_several_workers_pins_its_sources_and_frees_its_temporaries():
    async def main():
        hosts, controller, session = _setup()
        check = controller.ledger.validate_state
        split = Sharding(ShardingKind.CONCRETE_EVEN, IDS, shard_shape=(1,),
                         boxes=tuple(((i, i + 1),) for i in range(HOSTS)))
        x = session.arrays.make_array(F32, (HOSTS,), split,
                                      HostData(np.arange(HOSTS, dtype=np.float32)))
        await _step(controller)
        (whole,) = session.moves.reshard([x], [Sharding.single(0)])
        check()
        await _step(controller)
        pulls = hosts[0].pulls
        assert len(pulls) == HOSTS - 1  # shards 1 and 2, into temporaries beside host 0
        assert all(x.group.pinned(p) for p in range(HOSTS))  # by the pulls and the assembly
        assert whole.group.states() == {ShardState.PENDING}
        session.arrays.release([x])
        await _step(controller)
        assert _frees(hosts) == set()
        hosts[0].answer_pulls()
        await _step(controller)
        temps = {request.dst for request, _ in pulls}
        assert temps | {x.group.base} <= _frees(hosts)
        assert [type(x).__name__ for x in hosts[0].commands()].count("Assemble") == 1
        assert whole.group.states() == {ShardState.DEFINED} and whole.problem() is None
        await session.close()
        await _step(controller)
        assert controller.ledger.live_groups() == []
    run(main())
