"""Flow control between clients and workers: a client never runs unboundedly ahead.

Each worker channel counts the weight of the commands it has sent (`messages.weight`) and the
worker reports what it has applied (`messages.Applied`). A worker whose backlog passes
`high` closes the fleet's gate; the gate opens again once every such worker is back under
`low`. While the gate is closed the controller reads no new requests from client sessions,
so gRPC's own flow control slows the client down: a client that runs ahead waits, and never
fails. Liveness does not depend on any of this (the workers' pulses travel apart).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True, slots=True)
class FlowLimits:
    high: int = 4096  # backlog (in command weight) at which a worker holds clients back
    low: int = 2048  # backlog under which it lets them go again


class FlowGate:
    """Open while no worker has too much outstanding work."""

    def __init__(self, limits: FlowLimits | None = None) -> None:
        self.limits = limits or FlowLimits()
        self._congested: set[Hashable] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._eased: asyncio.Event | None = None  # set when some worker caught up
        self.closed_count = 0  # how often the gate closed (for status and tests)

    @property
    def is_open(self) -> bool:
        return not self._congested

    def report(self, key: Hashable, backlog: int) -> None:
        """A worker's backlog changed (`key` names the worker)."""
        if backlog >= self.limits.high:
            if key not in self._congested:
                self._congested.add(key)
                self.closed_count += 1
                self._open.clear()
        elif backlog < self.limits.low:
            self.forget(key)

    def forget(self, key: Hashable) -> None:
        """The worker is gone, or caught up."""
        self._congested.discard(key)
        if not self._congested:
            self._open.set()
        if self._eased is not None:
            self._eased.set()
            self._eased = None

    async def wait(self) -> None:
        await self._open.wait()

    def open_for(self, keys: frozenset[Hashable]) -> bool:
        return not self._congested or not (self._congested & keys)

    async def wait_for(self, keys: frozenset[Hashable]) -> None:
        """Until none of the workers `keys` is congested."""
        while not self.open_for(keys):
            if self._eased is None:
                self._eased = asyncio.Event()
            await self._eased.wait()


class ScopedFlow:
    """The gate as the clients of some workers see it (a shared service's lease): only
    those workers' backlogs hold them back, so one tenant's flood never stalls another."""

    def __init__(self, gate: FlowGate, keys: frozenset[Hashable]) -> None:
        self.gate, self.keys = gate, keys

    @property
    def is_open(self) -> bool:
        return self.gate.open_for(self.keys)

    async def wait(self) -> None:
        await self.gate.wait_for(self.keys)
