"""The collective group of a fleet's workers, formed again whenever its membership changes
(a part of the `FleetManager`, held by it; manager.py has the model).

A re-formation waits a moment for the losses and registrations that come with the one that
asked for it, then sends every member a `FormGroup` of a new generation on a fresh
coordination service (and one for the colocated CPU devices' group), waits for their jaxlib
ids of the devices, and sends them all the map from global ids. Slices whose every host is a
member are up again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from isthmus.compat import jax as jax_compat
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.ids import SliceId, WorkerId
from isthmus.logs import event
from isthmus.ports import free_port
from isthmus.transport import messages as m
from isthmus.transport.remote import RemoteWorker

logger = logging.getLogger(__name__)

# Seconds before a re-formation, for the losses (a dead slice's hosts, within milliseconds)
# and, longer, the registrations (a slice's workers start over a while) that come together.
LOSS_SETTLE, JOIN_SETTLE = 0.05, 0.2


class Shape(Protocol):
    """What a formation reads of the fleet's shape (`manager.FleetSpec`)."""

    @property
    def slices(self) -> int: ...

    @property
    def hosts_per_slice(self) -> int: ...


class Settings(Protocol):
    """What a formation reads of the manager's settings (`manager.ManagerConfig`)."""

    @property
    def formation_timeout(self) -> float: ...

    @property
    def advertise_host(self) -> str: ...

    @property
    def unix_dir(self) -> str | None: ...


class Slots(Protocol):
    """The fleet's host slots, as the manager numbers them."""

    def slot(self, slice_index: int, host: int) -> WorkerId:
        """The slot of a slice's host."""
        ...

    def slices(self) -> list[SliceId]:
        """The slices the fleet knows."""
        ...

    def slot_devices(self, slot: WorkerId) -> list[Device]:
        """A slot's devices."""
        ...


class GroupFormation:
    """Forms the collective group of the live workers: `want` asks for a re-formation (a
    worker joined, or one was lost), `run` forms it whenever asked, `members` are the slots
    of the current group."""

    def __init__(self, spec: Shape, fleet: WholeFleet, config: Settings, slots: Slots,
                 on_generation: Callable[[int], None]) -> None:
        self.spec = spec
        self.fleet = fleet
        self.config = config
        self.slots = slots
        self._on_generation = on_generation
        self.members: dict[WorkerId, RemoteWorker] = {}  # slots in the current group
        self._services: list[object] = []  # coordination services of every generation
        self._form_lock = asyncio.Lock()
        self._form_wanted = asyncio.Event()  # set by a loss or a registration
        self._joined = False  # a worker registered since the last re-formation began
        self._losses: list[str] = []  # losses since the group last formed (for errors)
        self.formed = asyncio.Event()  # set once the first group formed

    def want(self, *, joined: bool = False, loss: str = "") -> None:
        """Asks for a re-formation: a worker `joined`, or one was lost (`loss`, its error's
        words, told to the members with the new group), or one left on purpose."""
        if joined:
            self._joined = True
        if loss:
            self._losses.append(loss)
        self._form_wanted.set()

    def leave(self, slot: WorkerId) -> None:
        """A slot's worker is gone: no longer a member of the group."""
        self.members.pop(slot, None)
        self.fleet.members = set(self.members)

    async def run(self) -> None:
        """Forms the group whenever `want` asks (a task of the manager's)."""
        while True:
            await self._form_wanted.wait()
            await asyncio.sleep(LOSS_SETTLE)
            if self._joined or self.fleet.generation == 0:
                await asyncio.sleep(JOIN_SETTLE - LOSS_SETTLE)
            self._joined = False
            if self.fleet.generation == 0:
                # The first group: give the whole fleet a moment to register, so that it
                # forms once rather than once per straggler.
                expected = self.spec.slices * self.spec.hosts_per_slice
                deadline = time.monotonic() + 10.0
                while len(self.fleet.workers) < expected and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            self._form_wanted.clear()
            try:
                await self.form()
            except Exception:
                logger.exception("forming the collective group failed")
                await asyncio.sleep(1.0)
                self._form_wanted.set()

    async def form(self) -> None:
        async with self._form_lock:
            members = [c for _, c in sorted(self.fleet.workers.items())
                       if isinstance(c, RemoteWorker)]
            if not members:
                return
            generation = self.fleet.generation + 1
            address = self._group_address(generation, "group")
            def serve(at: str) -> object:
                return jax_compat.jaxlib_extension().get_distributed_runtime_service(
                    at, len(members), recoverable=True)

            loop = asyncio.get_running_loop()
            self._services.append(await loop.run_in_executor(None, serve, address))
            # Colocated CPU devices form a group of their own (one more CPU client per host).
            companion_address = ""
            if self.fleet.companions:
                companion_address = self._group_address(generation, "companions")
                self._services.append(
                    await loop.run_in_executor(None, serve, companion_address))
            logger.info("forming collective group %s with %s workers at %s", generation,
                        len(members), address,
                        extra=event("group_forming", generation=generation))
            # What was dispatched before this point runs in the old group: shared commands
            # still in the fleet's outbox go out ahead of the FormGroup.
            self.fleet.flush()
            waits = []
            reason, self._losses = " ".join(self._losses), []
            slots = {c.slot for c in members}
            gone = tuple(d.id for d in self.fleet.devices if d.worker not in slots)
            for node, channel in enumerate(members):
                number, future = channel.request()
                channel.send_now(m.FormGroup(number, generation, address, node, len(members),
                                             reason, gone, companion_address))
                channel.hold()
                channel.forming = True
                waits.append(future)
            try:
                replies = await asyncio.wait_for(asyncio.gather(*waits),
                                                 self.config.formation_timeout)
            except BaseException:
                for channel in members:
                    channel.release()
                raise
            finally:
                now = time.monotonic()
                for channel in members:
                    channel.forming = False
                    channel.last_seen = max(channel.last_seen, now)
            mapping: dict[int, int] = {}
            for channel, local_ids in zip(members, replies):
                for device, jaxlib_id in zip(self.slots.slot_devices(channel.slot), local_ids):
                    mapping[device.id] = jaxlib_id
            for channel in members:
                channel.send_now(m.DeviceMap(mapping))
                channel.release()
            self.members = {c.slot: c for c in members if self.fleet.workers.get(c.slot) is c}
            self.fleet.members = set(self.members)
            self.fleet.generation = generation
            for slice_index in self.slots.slices():
                hosts = [self.slots.slot(slice_index, h) for h in range(self.spec.hosts_per_slice)]
                if all(h in self.members for h in hosts):
                    self.fleet.mark_up(slice_index)
            self._on_generation(generation)
            self.formed.set()
            up = [s for s in self.slots.slices() if self.fleet.slice_error(s) is None]
            logger.info("collective group %s formed; slices up: %s", generation, up,
                        extra=event("group_formed", generation=generation, slices_up=up))

    def _group_address(self, generation: int, what: str) -> str:
        """Where a generation's coordination service listens: a free TCP port, or a Unix
        socket of a fleet on one machine without TCP (gRPC serves both)."""
        if self.config.unix_dir is not None:
            return f"unix:{self.config.unix_dir}/{what}-{generation}.sock"
        host = self.config.advertise_host
        return f"{host}:{free_port(host)}"

    async def wait_complete(self, timeout: float) -> None:
        """Waits until every slice of the spec is up."""
        deadline = time.monotonic() + timeout
        while True:
            if all(self.fleet.slice_error(SliceId(s)) is None for s in range(self.spec.slices)):
                return
            if time.monotonic() > deadline:
                down = {int(s): e.message for s, e in self.fleet.down_slices.items()}
                raise TimeoutError(f"the fleet was not complete within {timeout:g} s: {down}")
            await asyncio.sleep(0.1)
