"""The table from IFRT request kinds (oneof cases of `IfrtRequest`) to handlers.

A handler is `handler(session, request, response) -> None | Awaitable[None]`: it reads its
part of `request`, fills its part of `response` (always setting the oneof, even to an empty
message) or raises `IsthmusError`. A handler that must wait (for data, for a computation)
returns an awaitable; the session sends the response when it completes.

`result_handles` names the request fields that carry client-minted handles of results: when
the request fails, those handles are bound to the error, so the client's later uses report
the real cause rather than "unknown handle".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[Any, Any, Any], Awaitable[None] | None]


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    handler: Handler
    array_results: tuple[str, ...] = ()  # fields of the request body with result array handles
    future_results: tuple[str, ...] = ()  # fields with result future handles


HANDLERS: dict[str, Entry] = {}


def handles(kind: str, *, arrays: tuple[str, ...] = (), futures: tuple[str, ...] = ()
            ) -> Callable[[Handler], Handler]:
    """Registers the decorated function as the handler of request oneof case `kind`."""

    def register(fn: Handler) -> Handler:
        if kind in HANDLERS:
            raise RuntimeError(f"two handlers for {kind}")
        HANDLERS[kind] = Entry(fn, arrays, futures)
        return fn

    return register
