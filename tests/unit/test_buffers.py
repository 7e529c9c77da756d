"""A host's buffer store (`worker/buffers.py`): its states, its spans, and `validate_state`,
driven directly and through a real in-process `DeviceHost`."""

import asyncio

import numpy as np
import pytest

from isthmus import errors
from isthmus.worker.buffers import BufferStore
from isthmus.worker.host import DeviceHost, make_cpu_client
from isthmus.worker.slots import Failed, HostArray


class Computing:
    """A stand-in for a jax array whose computation has not finished."""

    def __init__(self, ready=False):
        self.ready = ready

    def is_ready(self):
        return self.ready

    def is_deleted(self):
        return False


def test_states_and_spans_follow_the_buffers():
    store = BufferStore()
    store.store(1, Computing())
    store.span(1, frozenset({0, 4}))
    store.store(2, HostArray(np.array(["a"], dtype=object)))
    store.inherit(3, [1, 2])  # 3 is made from 1 (still computing) and 2
    store.store(3, Computing())
    store.validate_state()
    assert store.spans_of([1, 2, 3]) == [frozenset({0, 4})] * 2
    store.fail(1, errors.ExecutionError("broke"))  # a failed buffer waits for nothing
    store.validate_state()
    assert store.spans_of([1]) == []
    with pytest.raises(errors.ExecutionError, match="broke"):
        store.value(1)
    with pytest.raises(errors.InternalError, match="buffer 9 is not on this host"):
        store.value(9)
    store.free([1, 3, 9])
    store.validate_state()
    assert store.ids() == [2] and not store.spanning()
    slots, spans = store.take_all()
    assert list(slots) == [2] and spans == {} and len(store) == 0


def test_validate_state_names_a_broken_invariant():
    store = BufferStore()
    store.store(1, Computing())
    store.span(2, frozenset({1}))  # a span of a buffer that is not stored
    with pytest.raises(AssertionError, match="span of buffer 2"):
        store.validate_state()
    store = BufferStore()
    store.store(1, Failed(ValueError("not an isthmus error")))
    with pytest.raises(AssertionError, match="buffer 1 failed with"):
        store.validate_state()
    store = BufferStore()
    store.store(1, "bytes?")
    with pytest.raises(AssertionError, match="buffer 1 holds str"):
        store.validate_state()


def test_a_device_host_keeps_its_store_valid_through_its_commands():
    async def main():
        host = DeviceHost(make_cpu_client(2))
        value = np.arange(6, dtype=np.float32).reshape(2, 3)
        await host.put(1, 0, value)
        host.buffers.validate_state()
        host.copy(1, 2, 1)
        host.bitcast(2, 3, np.dtype(np.int32), (6,))
        host.assemble(4, 0, None, np.dtype(np.float32), (1, 3),
                      [(1, (slice(1, 2), slice(0, 3)), (slice(0, 1), slice(0, 3)))])
        host.copy(99, 5, 0)  # an absent source: the copy holds the error
        await host.put(6, 0, np.array(["x"], dtype=object))
        host.buffers.validate_state()
        np.testing.assert_array_equal(await host.fetch(4), value[1:])
        np.testing.assert_array_equal(await host.fetch(3), value.view(np.int32).reshape(6))
        with pytest.raises(errors.InternalError, match="buffer 99"):
            await host.fetch(5)
        host.free([1, 2, 3, 4, 5, 6])
        host.buffers.validate_state()
        assert len(host.buffers) == 0
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_put_that_cannot_be_placed_fails_its_answer_and_its_slot():
    async def main():
        host = DeviceHost(make_cpu_client(1))
        with pytest.raises(errors.InvalidRequest, match="could not place the host data"):
            await host.put(7, 0, np.ones(4, np.float32), "no-such-memory")
        assert isinstance(host.buffers.slot(7), Failed)
        host.buffers.validate_state()
        await host.put(8, 0, np.ones(4, np.float32))  # answered: stored and ready
        assert host.buffers.value(8).is_ready()
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 30))
