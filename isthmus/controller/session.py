"""One client session's view of the controller: array operations, compilation, execution.

Every method returns at once. Operations that touch workers are queued on the session's
`OrderedDispatcher`; their outcome is either an array (whose errors surface when it is used)
or an awaitable the caller may wait on. Nothing here waits for device work.

A session is composed of parts, each in a module named after it. They share one
`SessionCore` (session_core.py: the controller, the fleet or a lease's part of it, the
dispatch queue, the tenant's files, background tasks) and see each other only through small
protocols of what they use:

- `session.arrays` (session_arrays.py): creating the session's arrays from host data,
  sharing and freeing them;
- `session.programs` (session_programs.py): the session's executables table, compiling and
  executing programs;
- `session.python` (session_python.py): colocated Python, compiled and called;
- `session.kept` (session_kept.py): arrays kept for a lease's next client, and taken back;
- `session.views` (session_views.py): arrays over existing buffers (disassemble, assemble,
  remap);
- `session.moves` (session_moves.py): copies, reshards, bitcasts and reads;
- `session.checkpoints` (session_checkpoints.py): checkpoints written and read by the
  workers;
- `session.profiles` (session_profiles.py): profiles of the fleet.
"""

from __future__ import annotations

import asyncio
import logging

from isthmus import errors
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import Fleet
from isthmus.controller.session_arrays import SessionArrays
from isthmus.controller.session_checkpoints import SessionCheckpoints
from isthmus.controller.session_core import SessionCore
from isthmus.controller.session_kept import SessionKept
from isthmus.controller.session_moves import SessionMoves
from isthmus.controller.session_profiles import SessionProfiles
from isthmus.controller.session_programs import SessionPrograms
from isthmus.controller.session_python import SessionPython
from isthmus.controller.session_views import SessionViews
from isthmus.controller.storage import TenantFiles

logger = logging.getLogger(__name__)


class Session:
    """Arrays and executables of one client session, held by its parts."""

    def __init__(self, controller: Controller, fleet: Fleet | None = None, namespace: str = "",
                 files: TenantFiles | None = None, python_refusal: str | None = None) -> None:
        self.core = core = SessionCore(controller, fleet, namespace, files, python_refusal)
        self.arrays = arrays = SessionArrays(core)
        self.programs = programs = SessionPrograms(core, arrays)
        self.python = SessionPython(core, arrays, programs)
        self.kept = SessionKept(core, arrays, programs)
        self.views = SessionViews(arrays)
        self.moves = SessionMoves(core, arrays, programs)
        self.checkpoints = SessionCheckpoints(core, arrays, programs)
        self.profiles = SessionProfiles(core, arrays, programs)

    @property
    def validating(self) -> bool:
        """The controller runs in validate mode (`ControllerConfig.validate`)."""
        return self.core.controller.config.validate

    def validate(self, cause: str) -> None:
        """Validate mode: raises InternalError where the controller's records disagree
        after `cause` (`Controller.validate`)."""
        self.core.controller.validate(cause)

    async def close(self) -> None:
        """Frees everything the session still holds."""
        core = self.core
        if core.closed:
            return
        core.closed = True
        self.arrays.close()
        self.programs.close()
        self.profiles.close()
        try:
            await asyncio.wait_for(core.dispatcher.flush(), 60)
        except TimeoutError:
            logger.warning("a closing session's queue did not drain within 60 s")
            core.dispatcher.abandon(errors.SessionClosed(
                "the session closed before this operation could run."))
        for task in list(core.tasks):
            task.cancel()
        core.controller.sessions.discard(core)
