"""The state every part of a controller session shares, the protocols through which parts
see each other, and the helpers they have in common.

A `Session` (session.py) is a `SessionCore` and the parts that hold it; session.py says
which part holds what.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Protocol

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, BufferGroup
from isthmus.controller.controller import Controller
from isthmus.controller.dispatch import OrderedDispatcher
from isthmus.controller.executables import Executable
from isthmus.controller.fleet import Fleet
from isthmus.controller.storage import TenantFiles


class SessionCore:
    """The controller, fleet, queue, storage and background tasks of one session: what
    every part of it shares."""

    def __init__(self, controller: Controller, fleet: Fleet | None = None, namespace: str = "",
                 files: TenantFiles | None = None, python_refusal: str | None = None) -> None:
        self.controller = controller
        # What the session may use: the whole fleet, or a lease's part of it (`FleetView`).
        self.fleet: Fleet = fleet if fleet is not None else controller.fleet
        self.namespace = namespace  # a shared service's tenant (its own executables)
        self.python_refusal = python_refusal  # why it may not run colocated Python, or None
        # A shared service's tenant: where its files go and which workers it may profile
        # (`storage.TenantFiles`); None: locations are used as the client names them.
        self.files = files
        self.dispatcher = OrderedDispatcher()
        self.tasks: set[asyncio.Task[object]] = set()
        self.closed = False
        controller.sessions.add(self)

    def spawn(self, coroutine: Awaitable[object]) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class Keeper(Protocol):
    """The session's executables table, as a part that makes executables sees it
    (`SessionPrograms`)."""

    def keep(self, executable: Executable) -> None: ...


class Owner(Protocol):
    """Making an array over a new group, as a part that makes outputs sees the session's
    arrays (`SessionArrays`)."""

    def own(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
            group: BufferGroup) -> Array: ...

    def own_all(self, made: Sequence[tuple[dtypes.DType, tuple[int, ...], sh.Sharding,
                                           BufferGroup]]) -> list[Array]: ...


def as_error(e: BaseException, doing: str) -> errors.IsthmusError:
    if isinstance(e, errors.IsthmusError):
        return e
    return errors.InternalError(
        f"{doing} failed unexpectedly ({type(e).__name__}: {e}); this is a bug in isthmus: "
        "please report it.")
