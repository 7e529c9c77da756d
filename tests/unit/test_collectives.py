"""The worker's rules for dispatching collective programs (`worker/collectives.py`): how many
stay in flight over several local CPU devices, and the hold after one failed. Output shards
are stand-ins whose readiness the test controls; the rules see nothing else of them."""

import asyncio
import collections
import concurrent.futures
import threading

from isthmus.worker.collectives import CollectiveOrder
from isthmus.worker.slots import Loaded


class Shard:
    """An output shard that becomes ready (or fails) when the test says so."""

    def __init__(self):
        self.done = threading.Event()
        self.error = None
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
        self.done.wait(10)
        if self.error is not None:
            raise self.error

    def finish(self, error=None):
        self.error = error
        self.done.set()


class Cpu:
    platform = "cpu"


class Host(CollectiveOrder):
    HOLD_AFTER_FAILURE = 0.2

    def __init__(self):
        self._collectives = collections.deque()
        self._collective_failed = False
        self._shared_pool = True
        self._pool = concurrent.futures.ThreadPoolExecutor(2)
        loaded = Loaded.__new__(Loaded)
        loaded.positions, loaded.devices, loaded.span = (0, 1), (Cpu(), Cpu()), None
        self._executables = {7: loaded}


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 20))


def test_a_step_is_dispatched_while_one_runs_and_waits_behind_two():
    async def main():
        host, superseded = Host(), asyncio.Event()
        first, second = Shard(), Shard()
        await host.collective_settled(7, superseded)  # nothing in flight
        host.collective_started([first])
        await host.collective_settled(7, superseded)  # one in flight: room for the next
        host.collective_started([second])
        waiting = asyncio.ensure_future(host.collective_settled(7, superseded))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # two in flight: the third waits for the oldest
        first.finish()
        await waiting
        assert list(host._collectives) == [[second]]
    run(main())


def test_a_failed_collective_holds_the_next_until_the_group_re_forms():
    async def main():
        host, superseded = Host(), asyncio.Event()
        shard = Shard()
        host.collective_started([shard])
        shard.finish(RuntimeError("gloo: connection closed by peer"))
        host.collective_started([Shard()])  # dispatched meanwhile; notes the failure
        loop = asyncio.get_running_loop()
        began = loop.time()
        await host.collective_settled(7, superseded)
        assert loop.time() - began >= 0.2  # held for HOLD_AFTER_FAILURE
        assert not host._collective_failed and not host._collectives
        # Once the group is being replaced nothing waits, whatever is in flight.
        host.collective_started([Shard()])
        host.collective_started([Shard()])
        superseded.set()
        await host.collective_settled(7, superseded)
        assert not host._collectives
    run(main())


def test_a_program_whose_outputs_a_later_one_took_by_donation_counts_as_finished():
    """A training step donates the last step's outputs while that step may still run: the
    step they went to cannot start before it and is counted in its place (issue 36)."""
    async def main():
        host, superseded = Host(), asyncio.Event()
        first, kept, second = Shard(), Shard(), Shard()
        host.collective_started([first, kept])
        await host.collective_settled(7, superseded)
        first.deleted = True  # donated to the second step, still running
        host.collective_started([second])
        waiting = asyncio.ensure_future(host.collective_settled(7, superseded))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the first step's other output is still being computed
        kept.finish()
        await waiting
        assert list(host._collectives) == [[second]] and not host._collective_failed
        second.deleted = True  # all of a step's outputs donated: it counts as finished
        host.collective_started([Shard()])
        await asyncio.wait_for(host.collective_settled(7, superseded), 5)
        assert not host._collective_failed
    run(main())
