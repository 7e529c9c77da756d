"""What the controller asks of a worker, whatever carries the messages.

The commands are records (`commands.py`); a channel takes them in order, and they take effect
in that order on the worker. `send` is fire-and-forget: a command's failures land in the
buffers it was to produce. `ask` issues a request at once (so it is ordered with the others)
and lets the caller wait for its answer later.

`isthmus.worker.host.DeviceHost` implements this in-process (the embedded backend); a remote
worker's channel (`remote.py`) over the network; `controller.fleet.LostChannel` stands for a
worker that is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol, TypeGuard, TypeVar

from isthmus.transport.commands import Command, Request
from isthmus.transport.frames import Parts
from isthmus.transport.messages import Shared

_T = TypeVar("_T")


def answered(outcome: Awaitable[_T]) -> TypeGuard[asyncio.Future[_T]]:
    """True when a channel's awaitable already holds its result (an in-process host, or a
    small ready buffer): the caller may take `outcome.result()` now, with no task."""
    return (isinstance(outcome, asyncio.Future) and outcome.done()
            and not outcome.cancelled() and outcome.exception() is None)


class Commands:
    """Fire-and-forget commands addressed to several workers, recorded once.

    The fleet delivers the same object to every worker of a program or buffer group, so a
    command for a thousand hosts is built (and, over the network, serialized) once.
    `items` are the commands in order; `encoded` is for a transport to cache the serialized
    form in.
    """

    __slots__ = ("encoded", "items")

    def __init__(self, items: list[Command]) -> None:
        self.items = items
        # Over the network: the commands as one `Shared` message, and a batch of it alone.
        self.encoded: tuple[Shared, bytes | Parts] | None = None


class WorkerChannel(Protocol):
    # In the controller's own process (the embedded backend's host): its answers cost no
    # transfer, so nothing is asked of it ahead of a client's read (`readahead.py`).
    local: bool

    def send(self, command: Command) -> None:
        """Issues a fire-and-forget command."""

    def ask(self, request: Request[_T]) -> Awaitable[_T]:
        """Issues a request; the awaitable resolves with its answer (or fails with the
        worker's error, or with the worker's loss)."""

    def deliver(self, commands: Commands, more: bool = False) -> None:
        """Takes commands shared with other workers (in order with the rest); `more`: a
        command of this channel's own follows at once, so they may wait for it."""

    def stats(self) -> dict[str, int]:
        """Live buffers and bytes on the worker."""
