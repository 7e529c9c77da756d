"""The embedded backend's channel to its in-process `DeviceHost`: commands apply in the call
that issues them, in order, as a worker applies what it reads.

One exception keeps a client from hanging (and then aborting) the server: a program over
several local CPU devices while CPU_COLLECTIVES_IN_FLIGHT collective programs still run
(`CollectiveOrder.collective_backlog`). XLA:CPU meets a program's devices in a rendezvous on
a shared thread pool; with dozens of such programs queued on few cores every device thread
waits for a device that gets no thread, and after 40 s XLA aborts the process (local jax
does the same). So that program, and every command after it, wait here in order, and a task
applies them once the programs before have finished; answers to the requests among them
come then. A worker process does the same in its command loop (`agent.py`). The backlog
closes the fleet's flow gate (`transport/flow.py`) as a worker's does, so a client far ahead
waits in gRPC's flow control instead of growing it without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from isthmus import errors
from isthmus.transport import commands as c
from isthmus.transport.base import Commands

if TYPE_CHECKING:
    from collections.abc import Awaitable, Hashable

    from isthmus.transport.commands import Command, Request
    from isthmus.transport.flow import FlowGate

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class InlineOrder:
    """`send`, `ask` and `deliver` of an in-process `DeviceHost` (`host`)."""

    def __init__(self, host: Any) -> None:
        self._host = host
        self._backlog: collections.deque[tuple[Command, asyncio.Future[Any] | None]] = (
            collections.deque())
        self._drainer: asyncio.Task[None] | None = None
        self._flow: FlowGate | None = None
        self._key: Hashable = None

    def attach_flow(self, gate: FlowGate, key: Hashable) -> None:
        """Reports the backlog (a command weighs 1) to `gate` under `key`."""
        self._flow, self._key = gate, key

    @property
    def waiting(self) -> int:
        """Commands held back behind a collective program."""
        return len(self._backlog)

    def send(self, command: Command) -> None:
        if self._backlog or self._held(command):
            self._hold(command, None)
        else:
            command.apply(self._host)

    def ask(self, request: Request[_T]) -> Awaitable[_T]:
        if self._backlog or self._held(request):
            answer: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
            self._hold(request, answer)
            return answer
        return request.apply(self._host)

    def deliver(self, commands: Commands) -> None:
        for command in commands.items:
            self.send(command)

    def close(self) -> None:
        """Fails what still waits (the server is stopping)."""
        if self._drainer is not None:
            self._drainer.cancel()
        while self._backlog:
            _, answer = self._backlog.popleft()
            if answer is not None and not answer.done():
                answer.set_exception(errors.SessionClosed("the server is shutting down."))

    def _held(self, command: Command) -> bool:
        return isinstance(command, c.Execute) and bool(
            self._host.collective_backlog(command.executable))

    def _hold(self, command: Command, answer: asyncio.Future[Any] | None) -> None:
        self._backlog.append((command, answer))
        if self._flow is not None and len(self._backlog) >= self._flow.limits.high:
            self._flow.report(self._key, len(self._backlog))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._backlog:
            command, answer = self._backlog[0]
            if isinstance(command, c.Execute):
                older = self._host.collective_backlog(command.executable)
                if older:
                    await self._host.wait_for(older)
                    continue
            self._backlog.popleft()
            if self._flow is not None and len(self._backlog) < self._flow.limits.low:
                self._flow.report(self._key, len(self._backlog))
            try:
                result = command.apply(self._host)
            except Exception as e:
                if answer is None:
                    logger.exception("a held-back command raised; this is a bug in isthmus")
                elif not answer.done():
                    answer.set_exception(e)
                continue
            if answer is not None:
                _chain(result, answer)


def _chain(result: Awaitable[Any], answer: asyncio.Future[Any]) -> None:
    def copy(done: asyncio.Future[Any]) -> None:
        if answer.done():
            return
        if done.cancelled():
            answer.cancel()
        elif done.exception() is not None:
            answer.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            answer.set_result(done.result())

    asyncio.ensure_future(result).add_done_callback(copy)
