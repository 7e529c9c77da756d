"""A worker process applies what it reads (`worker/applying.py`): most requests by their own
record, answered at once when the answer is there already; one that waits for computations
(`Request.waits_for_computations`) is kept to be asked again if the group re-forms."""

import asyncio
import types

import numpy as np

from isthmus.ids import BufferId
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.worker.agent import WorkerAgent
from isthmus.worker.applying import CommandApplier
from isthmus.worker.host import DeviceHost, make_cpu_client


def _agent():
    """A worker's command applier on an in-process host, its replies recorded."""
    agent = WorkerAgent.__new__(WorkerAgent)  # no controller, links or process state
    agent.host = DeviceHost(make_cpu_client(1))
    agent.applier = CommandApplier(agent)
    agent._tasks, agent._waits = set(), {}
    sent = []
    agent.link = types.SimpleNamespace(send=sent.append)
    return agent, sent


def test_only_ready_and_fetch_wait_for_computations():
    waiting = {cls for cls in vars(c).values() if isinstance(cls, type)
               and issubclass(cls, c.Request) and cls.waits_for_computations}
    assert waiting == {c.Ready, c.Fetch}


def test_a_request_answered_already_is_answered_at_once_and_a_wait_is_kept():
    async def main():
        agent, sent = _agent()
        value = np.arange(6, dtype=np.float32)
        agent.applier.apply(m.Ask(1, c.Put(BufferId(1), 0, value)))  # a put that travels as itself
        agent.applier.apply(m.Ask(2, c.Ready((BufferId(1),))))
        # Both answered in the call that applied them: no task, nothing to ask again.
        assert [(r.request, r.value, r.error) for r in sent] == [(1, None, None),
                                                                (2, None, None)]
        assert not agent._tasks and not agent._waits
        agent.applier.apply(m.Ask(3, c.Ready((BufferId(1), BufferId(9)))))  # 9 is not here
        assert set(agent._waits) == {3}  # asked again of a new host if the group re-forms
        assert agent._waits[3][0] == m.Ask(3, c.Ready((BufferId(1), BufferId(9))))
        while agent._tasks:
            await asyncio.sleep(0)
        assert sent[2].request == 3 and "9" in sent[2].error.message
        assert not agent._waits
        agent.applier.apply(m.Ask(4, c.Fetch(BufferId(1))))
        np.testing.assert_array_equal(sent[3].value, value)
        await agent.host.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_long_backlog_of_commands_lets_the_event_loop_run_while_it_is_applied():
    """Messages queued faster than they apply (a client pipelining steps) are taken without
    a pause; the command loop still gives the event loop a turn every `YIELD_EVERY`, so that
    heartbeats, acknowledgements and the stream's reading go on meanwhile."""
    import time

    from isthmus.worker import reading

    async def main():
        agent = WorkerAgent.__new__(WorkerAgent)
        agent.applier = types.SimpleNamespace(applying="")
        applied = []

        async def handle(message):  # a step that applies without awaiting, as a Batch does
            time.sleep(0.002)
            applied.append(message)

        agent._handle = handle
        queue = asyncio.Queue()
        for n in range(100):  # 0.2 s of work, queued before the loop starts on it
            queue.put_nowait(n)
        queue.put_nowait(None)
        turns = []

        async def beside():  # a heartbeat: what needs the event loop while the backlog goes
            while True:
                turns.append(len(applied))
                await asyncio.sleep(0)

        other = asyncio.ensure_future(beside())
        await agent._apply_in_order(queue)
        other.cancel()
        assert applied == list(range(100))
        during = {n for n in turns if 0 < n < 100}
        # one turn every YIELD_EVERY (0.02 s = 10 steps here), not only once the queue is empty
        assert len(during) >= 0.2 / reading.YIELD_EVERY / 2, turns
    asyncio.run(asyncio.wait_for(main(), 30))
