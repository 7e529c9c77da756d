"""Assembles a head process: fleet, controller, front end and gRPC server.

`Head` is what `isthmus up` and `isthmus run` start, and what tests start in-process. The
embedded fleet is one in-process worker (a `DeviceHost`) owning N jaxlib CPU devices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from isthmus.controller.controller import Controller, ControllerConfig
from isthmus.controller.fleet import Device, Fleet
from isthmus.ids import DeviceId, SliceId, WorkerId

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class HeadConfig:
    """How to start a head process."""

    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # 0: pick a free port
    devices: int = 8  # CPU devices of the embedded backend
    controller: ControllerConfig = ControllerConfig()
    max_host_buffer_bytes: int = 1 << 40


def embedded_fleet(num_devices: int) -> tuple[Fleet, Any]:
    """One in-process worker with `num_devices` jaxlib CPU devices."""
    from isthmus.worker.host import DeviceHost, make_cpu_client

    if num_devices < 1:
        raise ValueError(f"--devices must be at least 1, not {num_devices}")
    client = make_cpu_client(num_devices)
    host = DeviceHost(client)
    worker = WorkerId(0)
    devices = [Device(DeviceId(d.id), worker, d.id, "cpu", d.device_kind, SliceId(0), 0)
               for d in client.devices()]
    return Fleet(devices, {worker: host}), host


class Head:
    """A running server: `await Head(config).start()`, then `await head.stop()`."""

    def __init__(self, config: HeadConfig) -> None:
        self.config = config
        self.server: Any = None
        self.frontend: Any = None
        self.port = 0
        self._hosts: list[Any] = []

    @property
    def address(self) -> str:
        host = self.config.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"grpc://{host}:{self.port}"

    async def start(self) -> str:
        from isthmus.frontend.service import Frontend, FrontendConfig
        from isthmus.protocol.schema import schema
        from isthmus.wire.servicer import start_server

        fleet, host = embedded_fleet(self.config.devices)
        self._hosts.append(host)
        controller = Controller(fleet, self.config.controller)
        self.frontend = Frontend(controller, schema(), FrontendConfig(
            max_host_buffer_bytes=self.config.max_host_buffer_bytes))
        self.server, self.port = await start_server(
            self.frontend, self.config.host, self.config.port)
        logger.info("serving %d devices at %s", len(fleet.devices), self.address)
        return self.address

    async def stop(self, grace: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self.frontend is not None:
            await self.frontend.close()
        for host in self._hosts:
            await host.close()
        self._hosts.clear()


async def serve_until(head: Head, stop: asyncio.Event) -> None:
    await head.start()
    try:
        await stop.wait()
    finally:
        await head.stop()
