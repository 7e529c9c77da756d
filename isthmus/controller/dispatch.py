"""Ordered dispatch of device operations.

Every operation that touches workers goes through a session's `OrderedDispatcher`, so that
workers see a session's operations in the order the client issued them (a delete never
overtakes the computation that reads the array; every host of a slice sees the same order).

An operation may depend on buffer groups that are not yet *defined*: their bytes are still on
the way from the client (a host buffer races the request that uses it). Such an operation waits,
and every operation after it waits behind it. When nothing is waiting, an operation runs at
once, inside the call that submits it: the common case costs no task and no hand-off.

Invariant: a waiting group always resolves, with data or with an error (host buffers have a
deadline), so the queue never stalls forever.

Flow control: the stock client never waits for its uploads, so a loop that puts fresh host
data every step can run arbitrarily far ahead of the uploads (each waits in a client thread).
When `QUEUE_HIGH` operations wait here, `has_room` turns false and the session's stream is not
read until fewer than `QUEUE_LOW` wait: the client blocks in its own stream write.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable

from isthmus.controller.arrays import BufferGroup

logger = logging.getLogger(__name__)

Operation = Callable[[], None]
QUEUE_HIGH = 256  # operations waiting for host data at which the session stops reading
QUEUE_LOW = 64  # ... and under which it reads again
# What an operation may wait for: a buffer group (until it is defined) or any future.
Dependency = BufferGroup | asyncio.Future


def _pending(dependency: Dependency) -> asyncio.Future | None:
    if isinstance(dependency, BufferGroup):
        return dependency.until_defined
    return None if dependency.done() else dependency


class OrderedDispatcher:
    """Runs operations in submission order, each once its input buffers are defined."""

    def __init__(self) -> None:
        self._queue: collections.deque[
            tuple[tuple[Dependency, ...], Operation, asyncio.Future[None] | None]] = (
            collections.deque())
        self._drainer: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._room.set()

    @property
    def depth(self) -> int:
        """Operations waiting for their inputs (for the metrics)."""
        return len(self._queue)

    @property
    def has_room(self) -> bool:
        return self._room.is_set()

    async def wait_for_room(self) -> None:
        await self._room.wait()

    def submit(self, inputs: Iterable[Dependency], operation: Operation,
               track: bool = False) -> asyncio.Future[None] | None:
        """Runs `operation` now, or queues it behind the operations waiting for their inputs.

        With `track`, returns a future that resolves when this operation has run (None: it
        already has), so that a caller waits for its own place in the order, not for
        operations submitted after it (an execution's status does this)."""
        inputs = tuple(inputs)
        if not self._queue and all(_pending(d) is None for d in inputs):
            _run(operation)
            return None
        loop = asyncio.get_running_loop()
        ran = loop.create_future() if track else None
        self._queue.append((inputs, operation, ran))
        if len(self._queue) >= QUEUE_HIGH:
            self._room.clear()
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        return ran

    async def _drain(self) -> None:
        while self._queue:
            inputs, operation, ran = self._queue[0]
            for dependency in inputs:
                waiting = _pending(dependency)
                if waiting is not None:
                    # Failures are recorded where the operation will look (buffer.error, the
                    # future itself); waiting is all this does.
                    await asyncio.wait([waiting])
            self._queue.popleft()
            if len(self._queue) < QUEUE_LOW:
                self._room.set()
            _run(operation)
            if ran is not None and not ran.done():
                ran.set_result(None)
        self._room.set()

    async def flush(self) -> None:
        """Waits until every submitted operation has run."""
        while self._drainer is not None and not self._drainer.done():
            await asyncio.shield(self._drainer)

    def abandon(self, error: BaseException) -> None:
        """Fails what waits on operations that will never run (the session is closing)."""
        for _, _, ran in self._queue:
            if ran is not None and not ran.done():
                ran.set_exception(error)


def _run(operation: Operation) -> None:
    try:
        operation()
    except Exception:
        logger.exception("a dispatched operation raised; this is a bug in isthmus")
