"""controller/readahead.py: what is learned, asked for, taken and forgotten (the end-to-end
behaviour, values compared with local jax, is tests/integration/test_readahead.py)."""

import asyncio
from types import SimpleNamespace

import numpy as np

from isthmus.controller import readahead
from isthmus.controller.arrays import Buffer
from isthmus.controller.groups import BufferGroup
from isthmus.transport import commands as c


class Channel:
    local = False  # a worker process's, as far as the controller can tell

    def __init__(self, asked: list) -> None:
        self.asked = asked

    def ask(self, request):
        self.asked.append(request)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(np.float32(len(self.asked)))
        return answer


class Fleet:
    def __init__(self) -> None:
        self.asked: list = []

    def channel(self, worker):
        return Channel(self.asked)


def _run(executable, fleet, origin=True):
    devices = tuple(SimpleNamespace(worker=w) for w in (0, 1))
    group = BufferGroup(100, devices, (0, 1), (4, 4))  # type: ignore[arg-type]
    if origin:
        group.origin = (executable.readahead, 0)
    outputs = [SimpleNamespace(group=group)]
    if executable.readahead:
        readahead.read_ahead(executable, outputs, fleet)  # type: ignore[arg-type]
    return group


def test_small_outputs_only():
    assert readahead.small((4, 4))
    assert readahead.small((readahead.READAHEAD_BYTES,))
    assert not readahead.small((4, readahead.READAHEAD_BYTES + 1))


def test_a_fetched_output_is_read_ahead_on_later_runs_and_forgotten_when_unread():
    async def body():
        executable, fleet = SimpleNamespace(readahead={}), Fleet()
        group = _run(executable, fleet)
        assert fleet.asked == [] and readahead.claim(Buffer(group, 1)) is None  # learns
        assert executable.readahead == {(0, 1): 0}
        group = _run(executable, fleet)
        assert [(type(r), r.buffer) for r in fleet.asked] == [(c.Fetch, 101)]
        answer = readahead.claim(Buffer(group, 1))
        assert answer is not None and answer.result() == np.float32(1)
        assert readahead.claim(Buffer(group, 1)) is None  # taken once: a second read asks
        assert readahead.claim(Buffer(group, 0)) is None  # position 0 was never read ahead
        executable.readahead.pop((0, 0))
        for _ in range(readahead.FORGET_AFTER):  # runs whose value nobody takes
            _run(executable, fleet)
        assert executable.readahead == {(0, 1): readahead.FORGET_AFTER}
        _run(executable, fleet)
        assert executable.readahead == {}  # forgotten, and nothing asked that time
        assert len(fleet.asked) == 1 + readahead.FORGET_AFTER
    asyncio.run(body())


def test_a_failed_read_ahead_is_not_used():
    async def body():
        executable, fleet = SimpleNamespace(readahead={(0, 0): 0}), Fleet()
        group = _run(executable, fleet)
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(RuntimeError("lost"))
        assert group.beside is not None and group.beside.ahead is not None
        group.beside.ahead[0] = failed
        assert readahead.claim(Buffer(group, 0)) is None  # the fetch asks the worker again
        assert _run(executable, fleet, origin=False).origin is None
    asyncio.run(body())
