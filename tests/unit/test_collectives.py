"""The worker's rules for dispatching collective programs (`worker/collectives.py`): how many
stay in flight over several local CPU devices, and the hold after one failed. Output shards
are stand-ins whose readiness the test controls; the rules see nothing else of them."""

import asyncio
import concurrent.futures
import threading

from isthmus.worker.collectives import CollectiveOrder
from isthmus.worker.slots import Loaded


class Token:
    """The token of a run: ends (or fails) when the test says so."""

    def __init__(self):
        self.done = threading.Event()
        self.error = None

    def block_until_ready(self):
        self.done.wait(10)
        if self.error is not None:
            raise self.error

    def finish(self, error=None):
        self.error = error
        self.done.set()


class Shard(Token):
    """An output shard that becomes ready (or fails) when the test says so, and may be
    deleted (donated), as jaxlib's arrays are."""

    def __init__(self):
        super().__init__()
        self.deleted = False

    def is_ready(self):
        if self.deleted:  # as jaxlib's arrays do
            raise RuntimeError("INVALID_ARGUMENT: Array has been deleted.")
        return self.done.is_set()

    def is_deleted(self):
        return self.deleted

    def block_until_ready(self):
        if self.deleted:
            raise RuntimeError("INVALID_ARGUMENT: Array has been deleted.")
        super().block_until_ready()


def outputs(host):
    return [program.outputs for program in host.in_flight]


class Cpu:
    platform = "cpu"


class Host(CollectiveOrder):
    HOLD_AFTER_FAILURE = 0.2

    def __init__(self):
        loaded = Loaded.__new__(Loaded)
        loaded.positions, loaded.devices, loaded.span = (0, 1), (Cpu(), Cpu()), None
        super().__init__({7: loaded}, concurrent.futures.ThreadPoolExecutor(2), True,
                         lambda buffer_id, error: None)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 20))


def test_a_step_is_dispatched_while_one_runs_and_waits_behind_two():
    async def main():
        host, superseded = Host(), asyncio.Event()
        first, second = Shard(), Shard()
        await host.settled(7, superseded)  # nothing in flight
        host.started([first])
        await host.settled(7, superseded)  # one in flight: room for the next
        host.started([second])
        waiting = asyncio.ensure_future(host.settled(7, superseded))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # two in flight: the third waits for the oldest
        first.finish()
        await waiting
        assert outputs(host) == [[second]]
    run(main())


def test_a_failed_collective_holds_the_next_until_the_group_re_forms():
    async def main():
        host, superseded = Host(), asyncio.Event()
        shard = Shard()
        host.started([shard])
        shard.finish(RuntimeError("gloo: connection closed by peer"))
        host.started([Shard()])  # dispatched meanwhile; notes the failure
        loop = asyncio.get_running_loop()
        began = loop.time()
        await host.settled(7, superseded)
        assert loop.time() - began >= 0.2  # held for HOLD_AFTER_FAILURE
        assert not host.failed and not host.in_flight
        # Once the group is being replaced nothing waits, whatever is in flight.
        host.started([Shard()])
        host.started([Shard()])
        superseded.set()
        await host.settled(7, superseded)
        assert not host.in_flight
    run(main())


def test_a_program_whose_outputs_a_later_one_took_by_donation_is_known_by_the_rest():
    """A training step donates the last step's outputs while that step may still run: its
    outputs not donated tell when it ended (issue 36)."""
    async def main():
        host, superseded = Host(), asyncio.Event()
        first, kept, second = Shard(), Shard(), Shard()
        host.started([first, kept], Token())
        await host.settled(7, superseded)
        first.deleted = True  # donated to the second step, still running
        host.started([second], Token())
        waiting = asyncio.ensure_future(host.settled(7, superseded))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the first step's other output is still being computed
        kept.finish()
        await waiting
        assert outputs(host) == [[second]] and not host.failed
    run(main())


def test_a_program_whose_outputs_were_all_donated_is_waited_for_by_its_token():
    """A loop that donates everything it returns: each step's outputs are deleted as soon
    as the next step is dispatched, so only the token tells that a step ended. Counting it
    finished let hundreds of steps into flight and hung XLA:CPU (the default fleet)."""
    async def main():
        host, superseded = Host(), asyncio.Event()
        runs = []
        for _ in range(2):
            await host.settled(7, superseded)
            if runs:
                runs[-1][0].deleted = True  # donated to the step dispatched now
            runs.append((Shard(), Token()))
            host.started([runs[-1][0]], runs[-1][1])
        waiting = asyncio.ensure_future(host.settled(7, superseded))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # two in flight, the first known only by its token
        runs[0][1].finish()
        await waiting
        assert outputs(host) == [[runs[1][0]]] and not host.failed
        runs[1][0].deleted = True  # the third step took it, then the fourth comes
        host.started([Shard()], Token())
        runs[1][1].finish(RuntimeError("gloo: connection closed by peer"))
        began = asyncio.get_running_loop().time()
        await host.settled(7, superseded)
        # The second step's run failed, though its outputs went on: the next waits for the
        # group to re-form (HOLD_AFTER_FAILURE).
        assert asyncio.get_running_loop().time() - began >= 0.2
    run(main())


def test_a_runs_launch_id_is_its_own_and_the_same_on_every_worker():
    """What every worker of a run passes to jaxlib as its launch id: named by the run's
    first output's group base (the same command reaches every worker), a positive int32,
    different for different runs; a run without outputs keeps jaxlib's own count."""
    from isthmus.worker.host import launch_id

    ids = [launch_id((base, base + 8)) for base in (0, 8, 16, 2**31 - 2, 2**40 + 8)]
    assert len(set(ids)) == len(ids)
    assert all(0 < i < 2**31 for i in ids)
    assert launch_id((8,)) == launch_id((8, 64))
    assert launch_id(()) is None
