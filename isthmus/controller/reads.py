"""Settling a host read of a session's array: a fetch's distinct boxes assembled into the
whole array on the host, and a readiness wait's outcome (`SessionMoves.fetch`, `ready`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import cast

import numpy as np

from isthmus import errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array
from isthmus.controller.session_core import as_error


def assembled(array: Array, values: list[tuple[sh.Box, np.ndarray]]) -> np.ndarray:
    """The whole array on the host from the values of its distinct boxes."""
    if len(values) == 1 and values[0][0] == tuple((0, d) for d in array.shape):
        return values[0][1]
    host = np.empty(array.shape, dtype=object if array.dtype.is_string else array.dtype.numpy)
    for box, value in values:
        host[sh.box_slices(box)] = value
    return host


def settle_fetch(array: Array, box: sh.Box, done: asyncio.Future,
                 result: asyncio.Future[np.ndarray]) -> None:
    if result.done():
        return
    if done.cancelled():
        result.set_exception(errors.InternalError(
            "fetching the array was cancelled; this is a bug in isthmus: please report it."))
    elif done.exception() is not None:
        result.set_exception(as_error(cast(BaseException, done.exception()),
                                      "fetching the array"))
    else:
        try:
            result.set_result(assembled(array, [(box, done.result())]))
        except Exception as e:  # noqa: BLE001
            result.set_exception(as_error(e, "fetching the array"))


async def assemble_host(array: Array, pieces: list[tuple[sh.Box, Awaitable[np.ndarray]]],
                         result: asyncio.Future[np.ndarray]) -> None:
    try:
        values = await asyncio.gather(*(p for _, p in pieces))
        host = assembled(array, [(box, v) for (box, _), v in zip(pieces, values)])
        if not result.done():
            result.set_result(host)
    except Exception as e:  # noqa: BLE001
        if not result.done():
            result.set_exception(as_error(e, "fetching the array"))


async def settle(work: Awaitable[object], result: asyncio.Future[None],
                 arrays: Sequence[Array] = ()) -> None:
    """Resolves `result` once `work` is done: with its error, or the first error that
    `arrays` hold by then (a put's answer records it there)."""
    try:
        await work
        error = stored_error(arrays)
        if error is not None:
            raise error
        if not result.done():
            result.set_result(None)
    except Exception as e:  # noqa: BLE001
        if not result.done():
            result.set_exception(as_error(e, "waiting for the array"))


def stored_error(arrays: Sequence[Array]) -> errors.IsthmusError | None:
    """The first error a shard of `arrays` holds (not their deletion: a readiness wait
    does not race a later donation)."""
    for array in arrays:
        for buffer in array.shards:
            if buffer.error is not None:
                return buffer.error
    return None


def settle_on(answer: asyncio.Future[object], result: asyncio.Future[None],
              arrays: Sequence[Array]) -> None:
    """`settle` for one worker's answer, from its callback: no task for the usual wait of
    one array on one worker; an answer already in (the embedded host's, for a computed
    array) settles `result` now, a turn of the event loop sooner."""
    def done(_: object) -> None:
        if result.done():
            return
        if answer.cancelled():
            result.set_exception(errors.InternalError(
                "waiting for the array was cancelled; this is a bug in isthmus: please "
                "report it."))
            return
        error = answer.exception()
        if error is None:
            error = stored_error(arrays)
            if error is None:
                result.set_result(None)
                return
        result.set_exception(as_error(error, "waiting for the array"))

    if answer.done():
        done(answer)
    else:
        answer.add_done_callback(done)


def settle_when(waits: list[asyncio.Future[None]], result: asyncio.Future[None],
                arrays: Sequence[Array]) -> None:
    """`settle` for futures that never fail (the groups' `storing`), from their callbacks."""
    left = [len(waits)]

    def done(_: object) -> None:
        left[0] -= 1
        if left[0] == 0 and not result.done():
            error = stored_error(arrays)
            if error is None:
                result.set_result(None)
            else:
                result.set_exception(error)

    for wait in waits:
        wait.add_done_callback(done)
