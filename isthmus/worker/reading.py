"""Reading the controller's commands on a worker: the command loop's turns, shared commands
unpacked in place, the buffers a command makes, pieces of an incoming put, the
shared-directory probe, and a fetched buffer written into that directory."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Iterator
from typing import cast

import numpy as np

from isthmus import errors
from isthmus.hostmem import Assembly, write_file
from isthmus.ids import BufferId
from isthmus.transport import messages as m
from isthmus.transport.commands import Command, Told

# Seconds the command loop applies queued messages before it lets the event loop run once:
# the stream is read on, heartbeats and acknowledgements leave, answers go out.
YIELD_EVERY = 0.02


class Turns:
    """The messages of the command loop, in order, with a turn of the event loop now and then.

    While messages wait, taking one does not pause, and a batch of commands that wait for
    nothing applies without a pause: a backlog of thousands of steps would hold the event
    loop for seconds (no heartbeats, so the controller saw a stall; no acknowledgements, so
    its flow gate stayed shut). So a message taken `YIELD_EVERY` after the loop's last turn
    waits for one."""

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = time.monotonic()  # when the event loop last had a turn

    async def next(self, queue: asyncio.Queue[object]) -> object:
        if queue.empty():
            message = await queue.get()
            self._turn = time.monotonic()
            return message
        message = queue.get_nowait()
        if time.monotonic() - self._turn > YIELD_EVERY:
            await asyncio.sleep(0)
            self._turn = time.monotonic()
        return message


@dataclasses.dataclass(slots=True)
class Incoming:
    """A put arriving in pieces (`PutData`, `hostmem.Assembly`)."""

    pieces: Assembly
    device: int
    memory_kind: str | None
    dtype: m.NumpyDType
    shape: tuple[int, ...]

    def add(self, offset: int, data: m.Bulk | memoryview) -> np.ndarray:
        """Takes a piece; the value as it stands (whole once the last piece came)."""
        self.pieces.add(offset, data)
        return self.pieces.value(self.dtype, self.shape)


def probe_found(path: str, token: str) -> bool:
    """The controller's probe file is here with its contents: we share its machine."""
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def unpack(commands: tuple[object, ...]) -> Iterator[Told]:
    """The commands of a batch (`m.Batch.commands`: each a `Told`), with those shared by
    several workers decoded in place."""
    for command in cast("tuple[Told, ...]", commands):
        if isinstance(command, m.Shared):
            yield from cast("tuple[Command, ...]", m.decode(command.data))
        else:
            yield command


def produced(message: Told) -> tuple[BufferId, ...]:
    """The buffers a command would have made (an Execute fails its own outputs), whatever
    form it came in."""
    command = message.command if isinstance(message, m.Ask) else message
    if isinstance(command, Command):
        return command.produces()
    if isinstance(command, (m.PutData, m.PutWhole, m.PutObjects, m.PutFile)):
        return (command.buffer,)
    return ()


def request_of(message: Told) -> int | None:
    """The number a message's answer carries, if it is answered."""
    return getattr(message, "request", None)


async def write_fetched(fetched: Awaitable[np.ndarray], path: str) -> tuple[str, tuple[int, ...]]:
    """Writes a fetched buffer into a file of the controller's shared directory; answers
    (dtype name, shape)."""
    value = await fetched
    if value.dtype == object:
        raise errors.InternalError("string arrays do not travel through files; this is a "
                                   "bug in isthmus: please report it.")
    await asyncio.get_running_loop().run_in_executor(None, write_file, path, value)
    return m.dtype_name(value.dtype), tuple(value.shape)
