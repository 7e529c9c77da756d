"""Reading ahead the small results a client reads after every run of a program.

A training loop reads a handful of scalars after each step (the loss, the gradient norm,
the learning rate: MaxText reads a dozen), one after the other, and each read is a round
trip from the client to the controller, to the worker and back. Through a fleet that costs
a few milliseconds per scalar, during which the devices wait for the client's next step.

So the controller learns which small outputs a client reads: a group made by a program's
output of at most READAHEAD_BYTES per shard remembers where it came from (`origin`: the
executable and the output's index), and a client's fetch of one of its shards marks that
(output, position) on the executable. Every later run of that executable then asks the
worker for those shards right after the Execute (commands to a worker are applied in order,
and a Fetch waits for the computation), and keeps the answer's future on the output's group
(`ahead`: position -> future). A client's fetch takes it from there, so the value is on the
controller, or on its way, when the client asks. An (output, position) that four runs in a
row read ahead without the client taking it is forgotten, until a fetch marks it again.

The value read ahead is the output as its program made it, which is what any later fetch
of it returns (buffers are immutable; a donated or deleted array fails its fetch before its
shards are looked at). A read ahead that failed is not used: the fetch asks again, and
reports what the worker says then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from isthmus.ids import BufferId
from isthmus.transport import commands as c

if TYPE_CHECKING:
    from isthmus.controller.arrays import Array, Buffer
    from isthmus.controller.executables import Executable
    from isthmus.controller.fleet import Fleet

READAHEAD_BYTES = 4096  # per shard: scalars and small vectors, not activations
FORGET_AFTER = 4  # runs read ahead in a row with no fetch taking the value


def small(nbytes: Sequence[int]) -> bool:
    """Whether an output of these shard sizes is one to remember the origin of."""
    return max(nbytes, default=0) <= READAHEAD_BYTES


def read_ahead(executable: Executable, outputs: Sequence[Array], fleet: Fleet) -> None:
    """Asks for the shards clients read after earlier runs of `executable`, just after its
    Execute was sent; called only when `executable.readahead` is not empty."""
    wanted = executable.readahead
    for key, unclaimed in list(wanted.items()):
        if unclaimed >= FORGET_AFTER:
            del wanted[key]
            continue
        wanted[key] = unclaimed + 1
        index, position = key
        group = outputs[index].group
        if group is None:
            continue
        channel = fleet.channel(group.devices[position].worker)
        if channel.local:  # the embedded backend's host: a read costs no transfer
            continue
        answer = asyncio.ensure_future(channel.ask(
            c.Fetch(BufferId(group.base + position), group.nbytes[position])))
        answer.add_done_callback(_retrieved)
        beside = group.aside()
        if beside.ahead is None:
            beside.ahead = {}
        beside.ahead[position] = answer


def claim(buffer: Buffer) -> Awaitable[np.ndarray] | None:
    """The value read ahead for `buffer`, if there is a usable one (taken: a second fetch
    asks the worker); marks the buffer's output as one clients read, either way."""
    group = buffer.group
    origin = group.origin
    if origin is None:
        return None
    wanted, index = origin
    wanted[(index, buffer.position)] = 0
    ahead = None if group.beside is None else group.beside.ahead
    if ahead is None:
        return None
    answer = ahead.pop(buffer.position, None)
    if answer is None or (answer.done() and (answer.cancelled()
                                             or answer.exception() is not None)):
        return None
    return answer


def _retrieved(answer: asyncio.Future) -> None:
    """Marks a read ahead's failure as seen: nobody may ever take it."""
    if not answer.cancelled():
        answer.exception()
