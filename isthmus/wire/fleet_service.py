"""The gRPC service workers connect to: `isthmus.Fleet/Connect`, one stream per worker.

The worker sends `Register` first; the controller answers `Welcome` (or `Refused`) and from
then on sends command batches while the worker sends heartbeats, replies and data. A stream
that ends, for whatever reason, is the loss of that worker. `Alive` is the worker's pulse,
sent from a thread of its own so that a busy worker still proves itself alive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from isthmus import errors
from isthmus.controller.manager import FleetManager
from isthmus.transport import messages as m
from isthmus.wire.streams import END, drain

logger = logging.getLogger(__name__)

SERVICE = "isthmus.Fleet"


class FleetServicer:
    def __init__(self, manager: FleetManager) -> None:
        self.manager = manager

    async def connect(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        try:
            first = m.decode(await frames.__anext__())
        except (StopAsyncIteration, Exception):  # noqa: BLE001 - anything but a Register
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a worker stream must start with Register")
            return
        if not isinstance(first, m.Register):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a worker stream must start with Register")
            return
        try:
            channel = self.manager.register(first, queue.put_nowait, context.peer(),
                                            close=lambda: queue.put_nowait(END))
        except errors.IsthmusError as e:
            yield m.encode(m.Refused(e.message))
            return
        yield m.encode(self.manager.welcome(channel))
        reader = asyncio.get_running_loop().create_task(self._read(frames, channel, queue))
        try:
            async for item in drain(queue):
                yield item
        finally:
            reader.cancel()
            self.manager.lost(channel, "its connection to the controller closed")

    async def _read(self, frames: AsyncIterator[bytes], channel: Any,
                    queue: asyncio.Queue[Any]) -> None:
        try:
            async for frame in frames:
                channel.on_message(m.decode(frame))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken stream is a lost worker
            logger.info("worker %s stream ended: %s", channel.slot, e)
        queue.put_nowait(END)

    async def alive(self, token: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A worker's pulse (from its own thread, apart from its stream)."""
        return self.manager.alive(token.decode(errors="replace"))

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        return [grpc.method_handlers_generic_handler(SERVICE, {
            "Connect": grpc.stream_stream_rpc_method_handler(self.connect),
            "Alive": grpc.unary_unary_rpc_method_handler(self.alive),
        })]
