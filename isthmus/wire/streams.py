"""Pumping a server stream from a queue (shared by the client and worker services)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

END = object()  # put this on the queue to end the stream


async def drain(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """Yields what is put on `queue` until END."""
    while True:
        item = await queue.get()
        if item is END:
            return
        yield item
