"""Checked by mypy in `scripts/test`'s lint ([tool.mypy] in pyproject.toml), never run: the
worker's hosts are what commands are applied to (`CommandHost`). The worker layer is outside
the server's mypy run, so the assignment below brings the two hosts into it."""

from isthmus.transport.host import CommandHost
from isthmus.worker.host import DeviceHost
from isthmus.worker.simulated import SimulatedHost


def command_hosts(device: DeviceHost, simulated: SimulatedHost) -> list[CommandHost]:
    return [device, simulated]
