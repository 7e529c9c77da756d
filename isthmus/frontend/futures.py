"""CheckFuture and CheckValueReady: the client waits on the server's futures and arrays."""

from __future__ import annotations

from collections.abc import Awaitable

from isthmus.frontend.message import Message
from isthmus.frontend.session import FrontendSession


def check_future(session: FrontendSession, request: Message,
                 response: Message) -> Awaitable[None]:
    wait = session.take_future(request.check_future_request.future_handle)
    response.check_future_response.SetInParent()
    return wait()


def check_value_ready(session: FrontendSession, request: Message,
                      response: Message) -> Awaitable[None]:
    arrays = [session.array(h) for h in request.check_value_ready_request.value_handles]
    response.check_value_ready_response.SetInParent()
    return session.ctl.moves.ready(arrays)
