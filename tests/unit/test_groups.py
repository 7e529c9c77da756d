"""Buffer groups and shared commands: the controller's cost per program stays flat as fleets
grow. Driven in-process over the real worker channel (`RemoteWorker`) with streams that only
keep their frames; every frame is decoded and checked."""

import asyncio

import numpy as np
import pytest

from isthmus import errors
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.controller.session import Session
from isthmus.controller.session_arrays import HostData
from isthmus.controller.sharding import Sharding, ShardingKind
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.records import CompileRequest
from isthmus.transport.remote import RemoteWorker
from tests.unit.fakes import F32, HOSTS, Host


def _setup(channel=Host):
    hosts = {h: channel(h) for h in range(HOSTS)}
    devices = [Device(h, h, 0, "cpu", "cpu", 0, h) for h in range(HOSTS)]
    controller = Controller(WholeFleet(devices, hosts))
    return hosts, controller, Session(controller)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_a_program_is_one_shared_frame_for_every_host():
    async def main():
        hosts, controller, session = _setup()
        ids = tuple(range(HOSTS))
        executable = session.programs.compile(CompileRequest(b"", b"", ids))
        await executable.compiled
        x = session.arrays.make_array(F32, (HOSTS,), Sharding(ShardingKind.HLO, ids),
                                      HostData(np.zeros(HOSTS, np.float32)))
        await asyncio.sleep(0.01)
        for host in hosts.values():
            host.frames.clear()
        outputs = []
        for _ in range(5):
            (y,), _ = session.programs.execute(executable, [x])
            session.arrays.release([x])
            outputs.append(y)
            x = y
        controller.fleet.flush()
        frames = [host.frames for host in hosts.values()]
        assert all(f == frames[0] for f in frames)  # the very same bytes for every host
        commands = hosts[0].commands()
        executes = [x for x in commands if isinstance(x, c.Execute)]
        frees = [x for x in commands if isinstance(x, c.Free)]
        assert [e.results for e in executes] == [(y.group.base,) for y in outputs]
        assert executes[1].args == (outputs[0].group.base,)  # the step before's output
        # Each released input is freed as one id range covering every host's shard.
        assert [list(f.buffers) for f in frees][1:] == [
            list(range(y.group.base, y.group.base + HOSTS)) for y in outputs[:4]]
        await session.close()
    run(main())


def test_shared_shards_are_freed_when_their_last_holder_goes():
    async def main():
        hosts, controller, session = _setup()
        ids = tuple(range(HOSTS))
        x = session.arrays.make_array(F32, (HOSTS,), Sharding(ShardingKind.HLO, ids),
                                      HostData(np.zeros(HOSTS, np.float32)))
        await asyncio.sleep(0.01)
        controller.ledger.validate_state()
        parts = session.views.disassemble(x)
        session.arrays.release([x])
        await asyncio.sleep(0.01)
        controller.ledger.validate_state()
        assert not any(isinstance(x, c.Free) for h in hosts.values() for x in h.commands())
        session.arrays.release([parts[1]])
        await asyncio.sleep(0.01)
        controller.ledger.validate_state()
        freed = [x.buffers for h in hosts.values() for x in h.commands() if isinstance(x, c.Free)]
        assert freed == [(x.group.base + 1,)]  # only that shard, only on its host
        assert controller.ledger.accounting()[1]["buffers"] == 0
        assert controller.ledger.accounting()[0]["buffers"] == 1
        whole = session.views.assemble(F32, (HOSTS,), x.sharding,
                                 [parts[0], parts[2], _single(session, x, 1)])
        await asyncio.sleep(0.01)
        controller.ledger.validate_state()
        assert whole.group is None and whole.problem() is None
        await session.arrays.delete([parts[0]])
        controller.ledger.validate_state()
        assert whole.problem() is not None  # a deleted shard is gone for every sharer
        assert parts[2].problem() is None
        await session.close()
        assert controller.ledger.accounting() == {h: {"buffers": 0, "bytes": 0} for h in hosts}
    run(main())


def _single(session, x, position):
    """A new single-device array (a replica of `x`'s shape) on the device of its `position`."""
    device = x.sharding.devices[position]
    return session.arrays.make_array(F32, (HOSTS,), Sharding.single(device),
                                     HostData(np.ones(HOSTS, np.float32)))


def test_a_single_host_command_never_overtakes_a_shared_one():
    async def main():
        hosts, controller, _ = _setup()
        fleet = controller.fleet
        everyone = tuple(hosts)
        fleet.multicast(everyone, c.Free(range(10, 13)))
        fleet.channel(0).send(c.Copy(10, 20, 0, None))  # flushes the shared command first
        fleet.multicast(everyone, c.Free(range(20, 23)))
        await asyncio.sleep(0.01)
        fleet.flush()
        assert [type(x).__name__ for x in hosts[0].commands()] == ["Free", "Copy", "Free"]
        assert [list(x.buffers) for x in hosts[2].commands()] == [[10, 11, 12], [20, 21, 22]]
    run(main())


def test_host_data_its_workers_confirmed_is_ready_without_asking_again():
    async def main():
        hosts, controller, session = _setup()
        ids = tuple(range(HOSTS))
        sharding = Sharding(ShardingKind.HLO, ids)
        x = session.arrays.make_array(F32, (HOSTS,), sharding,
                                      HostData(np.zeros(HOSTS, np.float32)))
        await session.moves.ready([x])  # every put answered: no Ready goes out
        controller.fleet.flush()
        assert x.group.all_stored
        assert not [r for h in hosts.values() for r in h.commands()
                    if isinstance(r, m.Ask) and isinstance(r.command, c.Ready)]
        executable = session.programs.compile(CompileRequest(b"", b"", ids))
        await executable.compiled
        (y,), _ = session.programs.execute(executable, [x])
        waiting = asyncio.ensure_future(session.moves.ready([y]))  # computed: asked
        await asyncio.sleep(0.01)
        controller.fleet.flush()
        asked = [r for h in hosts.values() for r in h.commands()
                 if isinstance(r, m.Ask) and isinstance(r.command, c.Ready)]
        assert len(asked) == HOSTS and not y.group.all_stored
        waiting.cancel()
        await session.close()
    run(main())


def test_a_put_its_worker_could_not_store_fails_the_array():
    async def main():
        hosts, controller, session = _setup()

        async def refused():
            raise errors.InvalidRequest("could not place the host data on the device")

        hosts[1].ask = lambda request: (refused() if isinstance(request, c.Put)
                                        else Host.ask(hosts[1], request))
        x = session.arrays.make_array(F32, (HOSTS,),
                                      Sharding(ShardingKind.HLO, tuple(range(HOSTS))),
                                      HostData(np.zeros(HOSTS, np.float32)))
        with pytest.raises(errors.InvalidRequest, match="could not place"):
            await session.moves.ready([x])
        assert not x.group.all_stored
        await session.close()
    run(main())


class Holding(Host):
    """A worker channel whose put answers wait until the test gives them."""

    def __init__(self, slot):
        super().__init__(slot)
        self.puts = []

    def ask(self, request):
        if isinstance(request, c.Put):
            answer = RemoteWorker.ask(self, request)  # a real request: a PutWhole goes out
            self.puts.append(answer)
            return answer
        return super().ask(request)


def _kinds(host):
    return [type(x).__name__ for x in host.commands()]


def test_a_program_reading_small_host_data_goes_out_behind_the_puts_unanswered():
    async def main():
        hosts, controller, session = _setup(Holding)
        ids = tuple(range(HOSTS))
        executable = session.programs.compile(CompileRequest(b"", b"", ids))
        await executable.compiled
        x = session.arrays.make_array(F32, (HOSTS,), Sharding(ShardingKind.HLO, ids),
                                      HostData(np.zeros(HOSTS, np.float32)))
        (y,), _ = session.programs.execute(executable, [x])
        waiting = asyncio.ensure_future(session.moves.ready([x]))
        await asyncio.sleep(0.01)
        controller.fleet.flush()
        # Each worker stores a small put before its next command: the program follows it
        # on the channel at once, and nobody is asked whether the put is ready.
        assert all(_kinds(h) == ["PutWhole", "Execute"] for h in hosts.values())
        assert not waiting.done() and not x.group.all_stored
        for host in hosts.values():
            host.puts[0].set_result(None)
        await asyncio.wait_for(waiting, 5)
        assert x.group.all_stored
        controller.fleet.flush()
        assert all(_kinds(h) == ["PutWhole", "Execute"] for h in hosts.values())
        await session.close()
    run(main())


def test_readiness_of_small_host_data_reports_the_put_a_worker_refused():
    async def main():
        hosts, controller, session = _setup(Holding)
        ids = tuple(range(HOSTS))
        x = session.arrays.make_array(F32, (HOSTS,), Sharding(ShardingKind.HLO, ids),
                                      HostData(np.zeros(HOSTS, np.float32)))
        waiting = asyncio.ensure_future(session.moves.ready([x]))
        await asyncio.sleep(0.01)
        hosts[0].puts[0].set_result(None)
        hosts[1].puts[0].set_exception(
            errors.InvalidRequest("could not place the host data on the device"))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the third answer is still out
        hosts[2].puts[0].set_result(None)
        with pytest.raises(errors.InvalidRequest, match="could not place"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(errors.InvalidRequest, match="could not place"):
            await session.moves.ready([x])  # and later waits, from the recorded error
        await session.close()
    run(main())


def test_a_read_of_large_host_data_waits_for_the_puts_answers():
    async def main():
        hosts, controller, session = _setup(Holding)
        ids = tuple(range(HOSTS))
        rows = c.ORDERED_PUT_BYTES // 4 + 1  # a worker places this from a thread
        x = session.arrays.make_array(F32, (HOSTS * rows,), Sharding(ShardingKind.HLO, ids),
                                      HostData(np.zeros(HOSTS * rows, np.float32)))
        fetching = session.moves.fetch(x)
        await asyncio.sleep(0.01)
        controller.fleet.flush()
        assert all(_kinds(h) == ["PutWhole"] for h in hosts.values())  # the read waits
        for host in hosts.values():
            host.puts[0].set_result(None)
        await asyncio.sleep(0.01)
        controller.fleet.flush()
        assert len(_kinds(hosts[0])) == 2  # and goes out once they are answered
        fetching.cancel()
        await session.close()
    run(main())
