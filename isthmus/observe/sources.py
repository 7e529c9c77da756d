"""What the metrics and the view read, gathered from the parts of a running head.

`Sources` is the one place that knows where each figure lives (the front end's sessions,
the controller's counts and fleet, the fleet manager's workers, the launcher's restarts, a
shared service's lease book), so the collector and the view's state stay plain. It reads
on the event loop's thread and changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from isthmus.controller.fleet import Device
from isthmus.controller.session_core import SessionCore
from isthmus.ids import SliceId, WorkerId

if TYPE_CHECKING:
    from isthmus.controller.controller import Controller
    from isthmus.controller.leases import Listing
    from isthmus.controller.manager import FleetManager
    from isthmus.frontend.lease_service import SharedService
    from isthmus.frontend.service import Frontend
    from isthmus.frontend.session import FrontendSession
    from isthmus.launch import LocalLauncher


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """One host slot of the fleet, as it is now."""

    slot: int  # the worker slot (`WorkerId`)
    slice_index: int
    host_index: int  # within its slice
    state: str  # "up", "joining" (registered, not yet in the group) or "down"
    why: str | None  # why it is not up
    hostname: str
    pid: int | None
    backlog: int  # commands sent and not yet applied
    reported: dict[str, int]  # what the worker itself reports (`DeviceHost.stats`)
    devices: tuple[Device, ...]

    @property
    def up(self) -> bool:
        return self.state == "up"


class Head(Protocol):
    """The parts of a head that `Sources` reads (`isthmus.head.Head`): each None while
    absent."""

    frontend: Frontend | None
    manager: FleetManager | None
    launcher: LocalLauncher | None
    shared: SharedService | None


class Sources:
    """The readable state of a head."""

    def __init__(self, head: Head, loop_lag: Callable[[], float] = lambda: 0.0) -> None:
        self.head = head
        self.loop_lag = loop_lag

    @property
    def controller(self) -> Controller | None:
        frontend = self.head.frontend
        return frontend.controller if frontend is not None else None

    def live_controller(self) -> Controller:
        """The controller, which the readers below need: they are called once it exists."""
        controller = self.controller
        assert controller is not None
        return controller

    def slices(self) -> list[SliceId]:
        return sorted({d.slice_index for d in self.live_controller().fleet.devices})

    def hosts(self) -> list[Host]:
        """Every host slot, by slot."""
        fleet = self.live_controller().fleet
        by_slot: dict[WorkerId, list[Device]] = {}
        for device in fleet.devices:
            by_slot.setdefault(device.worker, []).append(device)
        manager = self.head.manager
        described = manager.status() if manager is not None else {}
        members = fleet.members
        down = fleet.down_slices
        hosts = []
        for slot in sorted(by_slot):
            devices = by_slot[slot]
            first = devices[0]
            channel = fleet.workers.get(slot)
            why = None
            if channel is None:
                state = "down"
                error = down.get(first.slice_index)
                why = error.message if error is not None else "no worker has joined this slot"
            elif members is not None and slot not in members:
                state, why = "joining", "joining the collective group"
            else:
                state = "up"
            entry = described.get(str(slot))
            hostname, pid, backlog = "", None, 0
            if manager is None:  # the embedded backend: this process
                hostname, pid = socket.gethostname(), os.getpid()
            elif entry is not None:
                hostname, pid, backlog = entry["host"], entry["pid"], entry["backlog"]
            reported = channel.stats() if channel is not None else {}
            hosts.append(Host(slot, first.slice_index, first.host_index, state, why,
                              hostname, pid, backlog, reported, tuple(devices)))
        return hosts

    def sessions(self) -> list[FrontendSession]:
        """The front end's open sessions."""
        frontend = self.head.frontend
        return list(frontend.sessions.values()) if frontend is not None else []

    def session_count(self) -> int:
        frontend = self.head.frontend
        return len(frontend.sessions) if frontend is not None else 0

    def losses(self) -> int:
        manager = self.head.manager
        return manager.lost_count if manager is not None else 0

    def restarts(self) -> int:
        launcher = self.head.launcher
        return launcher.restarted if launcher is not None else 0

    def queue_depth(self) -> int:
        return sum(session.dispatcher.depth for session in self.live_controller().sessions
                   if isinstance(session, SessionCore))

    def shared_book(self) -> Listing | None:
        """A shared service's leases, queue and figures (`LeaseBook.describe`), or None."""
        shared = self.head.shared
        return shared.book.describe() if shared is not None else None

    def shared_figures(self) -> dict[str, Any] | None:
        book = self.shared_book()
        if book is None:
            return None
        return {**book["figures"], "leases": len(book["leases"]), "queued": len(book["queue"])}
