"""One client session's view of the controller: array operations, compilation, execution.

Every method returns at once. Operations that touch workers are queued on the session's
`OrderedDispatcher`; their outcome is either an array (whose errors surface when it is used)
or an awaitable the caller may wait on. Nothing here waits for device work.

A session is its arrays and programs, built up in one line of mixins over `SessionCore`
(session_core.py, the shared state): creating, sharing and freeing arrays
(session_arrays.py), programs (session_programs.py), colocated Python (session_python.py)
and arrays kept for a lease's next client (session_persistence.py, `SessionKept`). What
works on those arrays is held as parts, each seeing the session through a narrow protocol
of its own: arrays over existing buffers (`Session.views`, session_sharing.py), copies,
reshards and reads (`Session.moves`, session_moves.py), checkpoints written by the workers
(`Session.checkpoints`, session_persistence.py) and profiles of the fleet
(`Session.profiles`, session_profiles.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from isthmus import errors
from isthmus.controller.controller import Controller
from isthmus.controller.session_moves import SessionMoves
from isthmus.controller.session_persistence import SessionCheckpoints, SessionKept
from isthmus.controller.session_profiles import SessionProfiles
from isthmus.controller.session_sharing import SessionViews

logger = logging.getLogger(__name__)


class Session(SessionKept):
    """Arrays and executables of one client session."""

    def __init__(self, controller: Controller, fleet: Any = None, namespace: str = "") -> None:
        super().__init__(controller, fleet, namespace)
        # Parts, each seeing the session through a narrow interface of its own.
        self.views = SessionViews(self)
        self.moves = SessionMoves(self)
        self.profiles = SessionProfiles(self)
        self.checkpoints = SessionCheckpoints(self)

    # ---- lifecycle -----------------------------------------------------------------------

    async def close(self) -> None:
        """Frees everything the session still holds."""
        if self.closed:
            return
        self.closed = True
        self.release(list(self._arrays))
        for executable in list(self._executables):
            self.release_executable(executable)
        self.profiles.close()
        try:
            await asyncio.wait_for(self.dispatcher.flush(), 60)
        except TimeoutError:
            logger.warning("a closing session's queue did not drain within 60 s")
            self.dispatcher.abandon(errors.SessionClosed(
                "the session closed before this operation could run."))
        for task in list(self._tasks):
            task.cancel()
        self.controller.sessions.discard(self)
