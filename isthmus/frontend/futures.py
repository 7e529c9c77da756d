"""CheckFuture and CheckValueReady: the client waits on the server's futures and arrays."""

from __future__ import annotations

from typing import Any

from isthmus.frontend.registry import handles


@handles("check_future_request")
def check_future(session: Any, request: Any, response: Any) -> Any:
    wait = session.take_future(request.check_future_request.future_handle)
    response.check_future_response.SetInParent()
    return wait()


@handles("check_value_ready_request")
def check_value_ready(session: Any, request: Any, response: Any) -> Any:
    arrays = [session.array(h) for h in request.check_value_ready_request.value_handles]
    response.check_value_ready_response.SetInParent()
    return session.ctl.moves.ready(arrays)
