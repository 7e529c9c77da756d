"""The state every part of a controller session shares, and the helpers they have in common.

A `Session` (session.py) is a line of mixins over `SessionCore` (arrays, programs, colocated
Python, kept arrays) that holds parts (views, moves, checkpoints, profiles); session.py says
which is which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from isthmus import errors
from isthmus.controller.arrays import Array
from isthmus.controller.controller import Controller, Executable
from isthmus.controller.dispatch import OrderedDispatcher
from isthmus.controller.storage import TenantFiles


class SessionCore:
    """The controller, queue, arrays, executables and background tasks of one session."""

    def __init__(self, controller: Controller, fleet: Any = None, namespace: str = "") -> None:
        self.controller = controller
        # What the session may use: the whole fleet, or a lease's part of it (`FleetView`).
        self.fleet = fleet if fleet is not None else controller.fleet
        self.namespace = namespace  # a shared service's tenant (its own executables)
        self.python_refusal: str | None = None  # why it may not run colocated Python, or None
        # A shared service's tenant: where its files go and which workers it may profile
        # (`storage.TenantFiles`); None: locations are used as the client names them.
        self.files: TenantFiles | None = None
        self.dispatcher = OrderedDispatcher()
        self._arrays: set[Array] = set()
        self._executables: list[Executable] = []
        self._tasks: set[asyncio.Task[object]] = set()
        self.closed = False
        controller.sessions.add(self)

    def keep(self, executable: Executable) -> None:
        """The session holds `executable` (it is released when the session closes)."""
        self._executables.append(executable)

    def spawn(self, coroutine: Awaitable[object]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def as_error(e: BaseException, doing: str) -> errors.IsthmusError:
    if isinstance(e, errors.IsthmusError):
        return e
    return errors.InternalError(
        f"{doing} failed unexpectedly ({type(e).__name__}: {e}); this is a bug in isthmus: "
        "please report it.")
