"""The embedded backend's channel to its in-process `DeviceHost`: commands apply in the call
that issues them, in order, as a worker applies what it reads.

One exception keeps a client from hanging (and then aborting) the server: a program over
several local CPU devices while CPU_COLLECTIVES_IN_FLIGHT collective programs still run
(`CollectiveOrder.backlog`). XLA:CPU meets a program's devices in a rendezvous on
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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from isthmus import errors
from isthmus.transport import commands as c
from isthmus.transport.base import Commands
from isthmus.transport.host import CommandHost

if TYPE_CHECKING:
    from collections.abc import Awaitable, Hashable, Sequence

    from isthmus.ids import ExecutableId
    from isthmus.transport.commands import Command, Request
    from isthmus.transport.flow import FlowGate
    from isthmus.worker.slots import Settling

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class Backlog(Protocol):
    """The collective programs in flight on a host (`CollectiveOrder`), as `InlineOrder`
    uses them."""

    def fail_outputs(self, executable_id: ExecutableId, results: Sequence[int],
                     error: errors.IsthmusError) -> None:
        """Makes this host's outputs of one run of a program error buffers."""
        ...

    def backlog(self, executable_id: ExecutableId) -> Sequence[Settling]:
        """What a program must wait for before it is dispatched ([]: it may go now)."""
        ...

    def wait_for(self, values: Sequence[Settling]) -> Awaitable[None]:
        """Resolves once these arrays are computed or donated."""
        ...


class InlineHost(CommandHost, Protocol):
    """What `InlineOrder` uses of its host (a `worker.host.DeviceHost`): the commands' host,
    and its collective programs in flight."""

    @property
    def collectives(self) -> Backlog:
        ...


class InlineOrder:
    """`send`, `ask` and `deliver` of an in-process `DeviceHost` (`host`)."""

    def __init__(self, host: InlineHost) -> None:
        self._host = host
        self._backlog: collections.deque[tuple[Command, asyncio.Future[object] | None]] = (
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
            self._apply(command)

    def ask(self, request: Request[_T]) -> Awaitable[_T]:
        if self._backlog or self._held(request):
            answer: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
            self._hold(request, answer)
            return answer
        return self._apply(request)

    def _apply(self, command: Command) -> Any:
        """Applies a command; one that raises is refused as a worker refuses it (its outputs
        hold the error, a request fails with it), so that nothing waits on what it was to
        make: the result, or for a request that raised, a future failed with the error."""
        try:
            return command.apply(self._host)
        except Exception as e:  # refused with the cause
            error = e if isinstance(e, errors.IsthmusError) else errors.InternalError(
                f"the embedded backend could not apply {type(command).__name__} "
                f"({type(e).__name__}: {e}); this is a bug in isthmus: please report it "
                "with the server's log.")
            if not isinstance(e, errors.IsthmusError):
                logger.exception("command %s failed; what it was to make holds the error",
                                 type(command).__name__)
            if isinstance(command, c.Execute):  # its outputs, by the program's positions
                self._host.collectives.fail_outputs(command.executable, command.results, error)
            for buffer_id in command.produces():
                self._host.fail(buffer_id, error)
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            failed.exception()  # a told command's failure is read from its outputs
            return failed

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
        return bool(self._older(command))

    def _older(self, command: Command) -> Sequence[Settling]:
        """What an Execute must wait for (`CollectiveOrder.backlog`); [] for other commands."""
        if not isinstance(command, c.Execute):
            return []
        try:
            return self._host.collectives.backlog(command.executable)
        except Exception:  # a bug: the command goes (and fails, or not)
            logger.exception("checking the collective programs in flight failed; this is a "
                             "bug in isthmus")
            return []

    def _hold(self, command: Command, answer: asyncio.Future[Any] | None) -> None:
        self._backlog.append((command, answer))
        if self._flow is not None and len(self._backlog) >= self._flow.limits.high:
            self._flow.report(self._key, len(self._backlog))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._backlog:
            command, answer = self._backlog[0]
            older = self._older(command)
            if older:
                await self._host.collectives.wait_for(older)
                continue
            self._backlog.popleft()
            if self._flow is not None and len(self._backlog) < self._flow.limits.low:
                self._flow.report(self._key, len(self._backlog))
            result = self._apply(command)
            if answer is not None:
                _chain(result, answer)


def _chain(result: Awaitable[object], answer: asyncio.Future[Any]) -> None:
    def copy(done: asyncio.Future[object]) -> None:
        if answer.done():
            return
        if done.cancelled():
            answer.cancel()
        elif done.exception() is not None:
            answer.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            answer.set_result(done.result())

    asyncio.ensure_future(result).add_done_callback(copy)
