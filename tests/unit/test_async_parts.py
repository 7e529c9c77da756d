"""The host-buffer store and the ordered dispatcher, driven without sockets."""

import asyncio

import pytest

from isthmus import errors
from isthmus.controller.arrays import BufferGroup
from isthmus.controller.dispatch import OrderedDispatcher
from isthmus.controller.fleet import Device
from isthmus.frontend.host_buffers import HostBufferStore


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def take(store, handle):
    """The buffer `store.when_ready` hands over, as a future."""
    future = asyncio.get_running_loop().create_future()

    def receive(data, error):
        if future.done():  # cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(data)

    store.when_ready(handle, receive)
    return future


def test_take_waits_for_an_upload_that_comes_later():
    async def main():
        store = HostBufferStore(start_timeout=5)
        waiter = take(store, 7)
        await asyncio.sleep(0.01)
        store.begin(7, 3)
        store.complete(7, memoryview(b"abc"))
        assert bytes(await waiter) == b"abc"
        assert len(store) == 0 and store.bytes_held == 0
    run(main())


def test_missing_upload_times_out_but_a_moving_one_does_not():
    async def main():
        # Margins for a loaded machine: a sleep of 0.05 s has to overrun to 0.5 s for the
        # upload to stop moving (0.1 s of timeout failed here once in a loaded suite).
        store = HostBufferStore(start_timeout=0.5)
        with pytest.raises(errors.HostBufferMissing, match="did not start arriving"):
            await take(store, 1)
        slow = take(store, 2)
        store.begin(2, 16)
        for filled in range(1, 16):  # 0.75 s of bytes, longer than the deadline
            await asyncio.sleep(0.05)
            store.progress(2, filled)
        store.complete(2, memoryview(b"x" * 16))
        assert bytes(await slow) == b"x" * 16
    run(main())


def test_an_upload_that_stops_fails_its_request():
    """Issue 47: a begun upload that brings no bytes for the deadline fails (it held every
    request of the session queued behind it, their futures too, forever)."""
    async def main():
        store = HostBufferStore(start_timeout=0.1)
        stalled = take(store, 3)
        store.begin(3, 16)
        store.progress(3, 8)
        started = asyncio.get_running_loop().time()
        with pytest.raises(errors.HostBufferMissing, match="8 of 16 bytes came"):
            await stalled
        assert asyncio.get_running_loop().time() - started < 1.0
        store.complete(3, memoryview(b"x" * 16))  # too late: dropped, nothing held
        assert len(store) == 0 and store.bytes_held == 0
    run(main())


def test_requests_naming_buffers_that_never_come_do_not_hold_off_the_deadline():
    """Issue 47: a client that keeps sending requests for buffers it never uploads used to
    keep every earlier request waiting (a new request counted as the session moving), and a
    status future behind them unanswered for good."""
    async def main():
        store = HostBufferStore(start_timeout=0.2)
        loop = asyncio.get_running_loop()
        first = take(store, 1)
        started, ended = loop.time(), []
        first.add_done_callback(lambda _: ended.append(loop.time()))
        later = []
        for handle in range(100, 112):  # a request every 0.05 s, none of them uploaded
            await asyncio.sleep(0.05)
            later.append(take(store, handle))
        with pytest.raises(errors.HostBufferMissing, match="host buffer 1 did not start"):
            await first
        assert ended[0] - started < 0.5
        for waiter in later:
            with pytest.raises(errors.HostBufferMissing):
                await waiter
        assert len(store) == 0
    run(main())


def test_a_waiting_request_outlasts_the_timeout_while_other_uploads_move():
    async def main():
        # Margins for a loaded machine: a sleep of 0.05 s has to overrun to 0.5 s for the
        # uploads to stop moving (0.2 s of timeout failed here once in a loaded suite).
        store = HostBufferStore(start_timeout=0.5)
        waiter = take(store, 1)
        for handle in range(10, 25):  # 0.75 s of other uploads, one every 0.05 s
            await asyncio.sleep(0.05)
            store.begin(handle, 1)
            store.complete(handle, memoryview(b"y"))
            assert bytes(await take(store, handle)) == b"y"
        assert not waiter.done()
        started = asyncio.get_running_loop().time()
        with pytest.raises(errors.HostBufferMissing, match="host buffer 1 did not start"):
            await waiter
        assert 0.25 < asyncio.get_running_loop().time() - started < 2.5
        assert len(store) == 0
    run(main())


def test_a_cancelled_request_leaves_no_waiter_behind():
    async def main():
        store = HostBufferStore(start_timeout=0.05)
        waiter = take(store, 4)
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0.1)  # the store's timer finds nothing to fail
        assert len(store) == 0
        store.begin(5, 1)
        store.complete(5, memoryview(b"z"))
        assert bytes(await take(store, 5)) == b"z"
    run(main())


def test_when_ready_hands_a_buffer_over_in_the_turn_it_is_there():
    async def main():
        store = HostBufferStore(start_timeout=0.1)
        got = []
        store.begin(1, 2)
        store.complete(1, memoryview(b"ab"))
        store.when_ready(1, lambda data, error: got.append((bytes(data), error)))
        assert got == [(b"ab", None)]  # here already: at once
        store.when_ready(2, lambda data, error: got.append((bytes(data), error)))
        store.begin(2, 1)
        assert len(got) == 1
        store.complete(2, memoryview(b"c"))
        assert got[-1] == (b"c", None)  # inside complete(), no task between
        store.when_ready(3, lambda data, error: got.append((data, error)))
        store.abort(3, errors.InvalidRequest("cut short"))
        assert got[-1][0] is None and "cut short" in got[-1][1].message

        def broken(data, error):
            raise RuntimeError("a bug in the receiver")
        store.when_ready(4, broken)
        store.begin(4, 1)
        store.complete(4, memoryview(b"d"))  # logged; the upload does not fail for it
        store.when_ready(5, lambda data, error: got.append((data, error)))  # never uploaded
        await asyncio.sleep(0.3)  # past the start deadline: the store's timer fails it
        assert got[-1][0] is None and "did not start arriving" in got[-1][1].message
        store.when_ready(6, lambda data, error: got.append((data, error)))
        store.close(errors.SessionClosed("gone"))
        assert isinstance(got[-1][1], errors.SessionClosed)
        assert len(store) == 0 and store.bytes_held == 0
    run(main())


def test_a_host_buffer_feeds_one_request():
    """A second claim of a handle (while the first waits, or after the first took it) is
    refused at once, and the first claim still gets the buffer; so is a handle named twice
    in one request, and an upload under a handle already used."""
    async def main():
        store = HostBufferStore(start_timeout=5)
        got = []
        store.when_ready(1, lambda data, error: got.append(("first", data, error)))
        with pytest.raises(errors.InvalidRequest, match="already used"):
            store.check_unclaimed([1])
        store.when_ready(1, lambda data, error: got.append(("second", data, error)))
        assert got[0][0] == "second" and "already used" in got[0][2].message
        store.begin(1, 2)
        store.complete(1, memoryview(b"ab"))
        assert got[1][0] == "first" and bytes(got[1][1]) == b"ab"
        with pytest.raises(errors.InvalidRequest, match="already used"):
            store.check_unclaimed([1])  # after it was taken
        store.when_ready(1, lambda data, error: got.append(("late", data, error)))
        assert got[2][0] == "late" and isinstance(got[2][2], errors.InvalidRequest)
        with pytest.raises(errors.InvalidRequest):
            store.begin(1, 2)  # uploaded again under a used handle
        with pytest.raises(errors.InvalidRequest, match="twice in this one"):
            store.check_unclaimed([5, 6, 5])
        store.check_unclaimed([5, 6])  # fresh handles pass
        assert store.bytes_held == 0
    run(main())


def test_close_fails_waiters():
    async def main():
        store = HostBufferStore(start_timeout=5)
        waiter = take(store, 3)
        await asyncio.sleep(0)
        store.close(errors.SessionClosed("gone"))
        with pytest.raises(errors.SessionClosed):
            await waiter
    run(main())


def _group(i, definers=0):
    return BufferGroup(i, (Device(0, 0, 0, "cpu", "cpu", 0, 0),), (0,), (4,), None, definers)


def test_dispatcher_runs_in_order_and_waits_for_inputs():
    async def main():
        dispatcher = OrderedDispatcher()
        order = []
        ready = _group(1)
        pending = _group(2, definers=1)
        dispatcher.submit([ready], lambda: order.append("a"))
        assert order == ["a"]  # nothing pending: runs inside submit
        dispatcher.submit([pending], lambda: order.append("b"))
        dispatcher.submit([ready], lambda: order.append("c"))  # waits behind b
        await asyncio.sleep(0.01)
        assert order == ["a"]
        pending.settle()
        await dispatcher.flush()
        assert order == ["a", "b", "c"]
    run(main())


def test_a_tracked_operation_resolves_when_it_runs_not_when_the_queue_drains():
    async def main():
        dispatcher = OrderedDispatcher()
        first, later = _group(1, definers=1), _group(2, definers=1)
        assert dispatcher.submit([], lambda: None, track=True) is None  # ran at once
        ran = dispatcher.submit([first], lambda: None, track=True)
        dispatcher.submit([later], lambda: None)  # never defined while we wait
        assert ran is not None and not ran.done()
        first.settle()
        await asyncio.wait_for(ran, 1)
        assert dispatcher.depth == 1  # the later one still waits
        closing = dispatcher.submit([], lambda: None, track=True)
        dispatcher.abandon(errors.SessionClosed("gone"))
        with pytest.raises(errors.SessionClosed):
            await asyncio.wait_for(closing, 1)
        later.settle()
        await dispatcher.flush()
    run(main())


def test_reads_in_flight_name_the_donated_arguments_they_need():
    """A read counts from the moment it is made until it ends; a donated argument (group
    base or ids per position) that one of its local shards is read by is named."""
    from isthmus.worker.reads import ReadsInFlight

    async def main():
        reads = ReadsInFlight()
        gate = asyncio.get_running_loop().create_future()
        assert not reads
        read = reads.track([11, 21], gate)
        assert reads and 11 in reads  # counted before the read starts running
        again = asyncio.ensure_future(reads.track([11], asyncio.sleep(0)))
        assert reads.donated_in_flight([10, (20, 21), 30], (0, 1), (0, 1, 2)) == {0, 1}
        assert reads.donated_in_flight([10, (20, 21)], (0,), (0, 1)) == set()  # 21 not local
        await again
        assert 11 in reads  # the other read of 11 still runs
        gate.set_result("done")
        assert await read == "done"
        assert not reads and 11 not in reads
    run(main())


def test_a_readiness_wait_on_one_workers_answer_settles_from_its_callback():
    """`reads.settle_on`: the answer, the error an array's shard holds by then, the worker's
    error as an isthmus error, and a cancelled answer reported rather than left waiting."""
    from types import SimpleNamespace

    from isthmus.controller import reads

    def arrays(error=None):
        return [SimpleNamespace(shards=[SimpleNamespace(error=None), SimpleNamespace(error=error)])]

    async def settled(outcome, held=None):
        loop = asyncio.get_running_loop()
        answer, result = loop.create_future(), loop.create_future()
        reads.settle_on(answer, result, arrays(held))
        assert not result.done()
        outcome(answer)
        return await asyncio.wait_for(asyncio.shield(result), 5)

    async def main():
        assert await settled(lambda a: a.set_result(None)) is None
        with pytest.raises(errors.ExecutionError, match="held"):
            await settled(lambda a: a.set_result(None), errors.ExecutionError("held"))
        with pytest.raises(errors.WorkerLost, match="gone"):
            await settled(lambda a: a.set_exception(errors.WorkerLost("gone")))
        with pytest.raises(errors.IsthmusError):
            await settled(lambda a: a.set_exception(RuntimeError("a bug")))
        with pytest.raises(errors.InternalError, match="cancelled"):
            await settled(lambda a: a.cancel())
    run(main())
