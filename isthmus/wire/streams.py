"""Pumping the session stream from a queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

from isthmus.wire.methods import Batch

END = object()  # put this on the queue to end the stream


async def drain(queue: asyncio.Queue[object]) -> AsyncIterator[object]:
    """Yields what is put on `queue` until END; what is there at once, as one `Batch` (when
    it is more than one item). An exception put there is raised after what came before it."""
    while True:
        item = await queue.get()
        if item is END:
            return
        if isinstance(item, BaseException):
            raise item
        if queue.empty():
            yield item
            continue
        items = [item]
        while not queue.empty():
            item = queue.get_nowait()
            if item is END or isinstance(item, BaseException):
                yield Batch(items) if len(items) > 1 else items[0]
                if item is END:
                    return
                raise cast(BaseException, item)
            items.append(item)
        yield Batch(items)
