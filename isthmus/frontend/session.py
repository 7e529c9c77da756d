"""One IFRT proxy session: its handle tables and the loop from requests to responses.

Requests are handled in arrival order, each inside `handle`, which never waits: a handler
either answers at once or hands back an awaitable, and the response goes out when that
completes. Responses carry the request's op_id, so they may overtake each other.

Each request kind (a case of `IfrtRequest`'s oneof) has one `Entry` in the table the
session dispatches on (`registry.HANDLERS`): its handler, and the request fields that carry
result handles. A kind the table lacks (a newer client's) is answered UNIMPLEMENTED.

Handles belong to the session (a session sees only its own). A handle bound to an error
(its creating request failed) reports that error on every use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, TypedDict

from isthmus import errors
from isthmus.controller.arrays import Array
from isthmus.controller.executables import Executable
from isthmus.controller.leases import Lease
from isthmus.controller.session import Session as ControllerSession
from isthmus.controller.session_kept import KeptArrays
from isthmus.frontend.host_buffers import HostBufferStore
from isthmus.frontend.message import Message
from isthmus.frontend.serdes import ArraySpec, HostShardSpec, Serdes
from isthmus.ids import SessionId
from isthmus.protocol.schema import Schema
from isthmus.protocol.versions import Version

logger = logging.getLogger(__name__)

# Handles the server mints start here, far above the small numbers the client mints.
SERVER_HANDLE_BASE = 1 << 62

Wait = Callable[[], Awaitable[None]]  # a future: resolves when its work is done, or raises

# What a session puts on its client's stream: a response, or the error that ends the stream
# (`FrontendSession.end`).
Send = Callable[[Message | errors.IsthmusError], None]


class Platform(TypedDict):
    """The platform sessions report (`InitResponse`)."""

    name: str
    version: str
    id: int  # a fingerprint of the name; only equality matters to clients
    runtime_type: str


class OptionsVetter(Protocol):
    """What a session asks of the compile options' vetter (`programs.CompileOptionsVetter`)."""

    def vet(self, serialized: Message, fleet_devices: Sequence[int]
            ) -> tuple[bytes, tuple[int, ...], int]: ...


class FrontendSession:
    """Handle tables and request dispatch of one client session."""

    def __init__(self, session_id: SessionId, version: Version, schema: Schema,
                 serdes: Serdes, handlers: Mapping[str, Entry],
                 controller_session: ControllerSession, host_buffers: HostBufferStore,
                 send: Send, platform: Platform, vetter: OptionsVetter, peer: str = "",
                 on_close: Callable[[FrontendSession], None] | None = None) -> None:
        self.id = session_id
        self.version = version
        self.schema = schema
        self.serdes = serdes
        self._handlers = handlers  # request kind -> its entry (`registry.HANDLERS`)
        self.ctl = controller_session
        self.fleet = controller_session.core.fleet
        self.host_buffers = host_buffers
        self.platform = platform
        self.vetter = vetter
        self.peer = peer
        self._on_close = on_close
        self._send = send
        self._response = schema["xla.ifrt.proxy.IfrtResponse"]
        self.arrays: dict[int, Array | errors.IsthmusError] = {}
        self.executables: dict[int, Executable | errors.IsthmusError] = {}
        self.futures: dict[int, Wait | errors.IsthmusError] = {}
        self.deleted_executables: set[int] = set()
        self._handles = itertools.count(SERVER_HANDLE_BASE)
        self._validate = controller_session.validating  # `check_after`
        # Where the ledger records what caused its moves (`controller/transitions.py`).
        self._transitions = controller_session.core.controller.ledger.transitions
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.lease: Lease | None = None  # on a shared service, the lease it runs under
        # ... and the service (`lease_service.SharedService`): untyped, since the wire layer
        # reads it beside the lease, without asking whether it is None.
        self.shared_service: Any = None
        self.requests = 0
        # MakeArraysFromHostBufferShards' specs checked so far (`transfers._check_shards`).
        self.checked_specs: dict[Hashable, tuple[ArraySpec, list[HostShardSpec]]] = {}
        self._seq = itertools.count()  # numbers OK responses, as the client expects

    # ---- the request loop ----------------------------------------------------------------

    @property
    def has_room(self) -> bool:
        """False while too many of this session's operations wait for their host data: the
        stream should not be read until `wait_for_room` returns (flow control)."""
        return self.ctl.core.dispatcher.has_room

    async def wait_for_room(self) -> None:
        await self.ctl.core.dispatcher.wait_for_room()

    def handle(self, request: Message) -> None:
        """Handles one request; its response is sent now or when its work completes."""
        self.requests += 1
        op_id = request.request_metadata.op_id
        response = self._response()
        response.response_metadata.op_id = op_id
        kind = request.WhichOneof("request")
        entry = self._handlers.get(kind) if kind else None
        transitions = self._transitions
        try:
            if kind is None or entry is None:
                raise errors.Unimplemented(
                    f"IFRT request {kind or '(empty)'} is not implemented by isthmus; see "
                    "docs/protocol.md for the requests it serves.")
            transitions.cause = (kind, op_id, self.id)
            pending = entry.handler(self, request, response)
            if pending is None and self._validate:
                self.check_after(request, kind)
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            self._fail(request, kind, response, e)
            return
        finally:
            transitions.cause = None
        if pending is None:
            _answered(response, kind)
            response.response_metadata.seq_num = next(self._seq)
            self._send(response)
        elif (isinstance(pending, asyncio.Future) and pending.done()
              and not pending.cancelled()):  # done already: answered now, no task, no turn
            error = pending.exception()
            if error is not None:
                self._fail(request, kind, response, error)
            else:
                self._answer_done(request, kind, response)
        else:
            self.background(self._finish(request, kind, response, pending))

    def background(self, work: Awaitable[None]) -> None:
        """Work of a request that runs on after `handle` (its answer, or work whose outcome
        goes elsewhere); it is cancelled when the session closes."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, request: Message, kind: str, response: Message,
                      pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception as e:  # noqa: BLE001
            self._fail(request, kind, response, e)
            return
        if not self.closed:
            self._answer_done(request, kind, response)

    def _answer_done(self, request: Message, kind: str, response: Message) -> None:
        """Answers a request whose work has completed; in validate mode the records are
        checked first (not the bindings: later requests may already have destroyed the
        results or checked the futures of a request answered late)."""
        if self._validate:
            try:
                self.ctl.validate(_cause(request, kind))
            except Exception as e:  # noqa: BLE001
                self._fail(request, kind, response, e)
                return
        _answered(response, kind)
        response.response_metadata.seq_num = next(self._seq)
        self._send(response)

    def _fail(self, request: Message, kind: str | None, response: Message,
              e: BaseException) -> None:
        error = e if isinstance(e, errors.IsthmusError) else errors.InternalError(
            f"handling {kind} failed unexpectedly ({type(e).__name__}: {e}); this is a bug in "
            "isthmus: please report it with the server log.")
        if not isinstance(e, errors.IsthmusError):
            logger.exception("session %s: %s failed", self.id, kind)
        entry = self._handlers.get(kind) if kind else None
        if kind is not None and entry is not None:
            body = getattr(request, kind)
            for field in entry.array_results:
                for handle in _handles_in(body, field):
                    if handle < SERVER_HANDLE_BASE:  # the server's own are never the client's
                        self.arrays.setdefault(handle, error)
            for field in entry.future_results:
                for handle in _handles_in(body, field):
                    if handle < SERVER_HANDLE_BASE:
                        self.futures.setdefault(handle, error)
        failed = self._response()
        failed.response_metadata.op_id = response.response_metadata.op_id
        failed.response_metadata.status.code = int(error.code)
        failed.response_metadata.status.message = error.message
        if not self.closed:
            self._send(failed)

    def check_after(self, request: Message, kind: str) -> None:
        """Validate mode, after a request's handler answered at once: every array and
        future handle the client minted for its results is bound (XLA's server checks this
        as it reserves them), and the controller's records agree (`Controller.validate`;
        a request answered later gets only this)."""
        cause = _cause(request, kind)
        body = getattr(request, kind)
        entry = self._handlers[kind]
        for fields, table, what in ((entry.array_results, self.arrays, "array"),
                                    (entry.future_results, self.futures, "future")):
            for field in fields:
                unbound = [h for h in _handles_in(body, field)
                           if h < SERVER_HANDLE_BASE and h not in table]
                if unbound:
                    logger.error("isthmus validate: %s succeeded without binding its %s "
                                 "handles %s (%s)", cause, what, unbound, field)
                    raise errors.InternalError(
                        f"validate mode: {cause} succeeded without binding the {what} "
                        f"handles {unbound} the client minted; this is a bug in isthmus: "
                        "please report it with the server log.")
        self.ctl.validate(cause)

    # ---- handle tables -------------------------------------------------------------------

    def new_handle(self) -> int:
        return next(self._handles)

    def array(self, handle: int) -> Array:
        value = self.arrays.get(handle)
        if value is None:
            raise errors.UnknownHandle(
                f"array handle {handle} is unknown in this session: it was never created, or "
                "was already destroyed. Arrays of other sessions are not visible.")
        if isinstance(value, errors.IsthmusError):
            raise value
        return value

    def bind_arrays(self, handles: Sequence[int], arrays: Sequence[Array]) -> None:
        """`bind_array` of each client handle to its array (a program's outputs), checked
        at once. A handle that may not be bound is refused: the arrays before it stay bound
        (the client holds them), it and those after it are released."""
        table = self.arrays
        if (len(set(handles)) != len(handles) or not table.keys().isdisjoint(handles)
                or max(handles, default=0) >= SERVER_HANDLE_BASE):
            for index, (handle, array) in enumerate(zip(handles, arrays)):
                try:
                    self.bind_array(handle, array)  # releases `array` when it refuses
                except errors.IsthmusError:
                    self.ctl.arrays.release(arrays[index + 1:])
                    raise
            return
        table.update(zip(handles, arrays))

    def bind_array(self, handle: int | None, array: Array) -> int:
        """Binds `array` to the client's handle (or a new server handle when None)."""
        if handle is None:
            handle = self.new_handle()
        elif handle in self.arrays or handle >= SERVER_HANDLE_BASE:
            self.ctl.arrays.release([array])
            raise _refused_handle("array", handle)
        self.arrays[handle] = array
        return handle

    def executable(self, handle: int) -> Executable:
        value = self.executables.get(handle)
        if value is None:
            raise errors.UnknownHandle(
                f"executable handle {handle} is unknown in this session: it was never "
                "compiled here, or was already destroyed.")
        if isinstance(value, errors.IsthmusError):
            raise value
        return value

    def add_future(self, handle: int | None, wait: Wait) -> int:
        if handle is None:
            handle = self.new_handle()
        elif handle >= SERVER_HANDLE_BASE:
            raise _refused_handle("future", handle)
        self.futures[handle] = wait
        return handle

    def take_future(self, handle: int) -> Wait:
        """The wait of a future, which leaves the table (the client checks a future once)."""
        wait = self.peek_future(handle)
        del self.futures[handle]
        return wait

    def peek_future(self, handle: int) -> Wait:
        value = self.futures.get(handle)
        if value is None:
            raise errors.UnknownHandle(
                f"future handle {handle} is unknown in this session (or was already checked).")
        if isinstance(value, errors.IsthmusError):
            error = value

            async def failed() -> None:
                raise error

            return failed
        return value

    # ---- lifecycle -----------------------------------------------------------------------

    def kept(self) -> KeptArrays:
        """The arrays this session's lease keeps for its next client (a shared service)."""
        return self.shared_service.kept(self.lease)

    def end(self, error: errors.IsthmusError) -> None:
        """Ends the session's stream with `error` as its status (its lease ended)."""
        if not self.closed:
            self._send(error)

    async def close(self) -> None:
        """Frees everything the session holds; pending responses are dropped."""
        if self.closed:
            return
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        self.host_buffers.close(errors.SessionClosed(
            "the session ended before this host buffer was used; reconnect and retry."))
        self.arrays.clear()
        self.executables.clear()
        self.futures.clear()
        with self._transitions.caused_by(f"session {self.id} closed"):
            await self.ctl.close()
        if self._on_close is not None:
            self._on_close(self)


Handler = Callable[[FrontendSession, Message, Message], Awaitable[None] | None]


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """How the session handles one request kind (`registry.HANDLERS` says which)."""

    handler: Handler
    array_results: tuple[str, ...] = ()  # fields of the request body with result array handles
    future_results: tuple[str, ...] = ()  # fields with result future handles


def _cause(request: Message, kind: str) -> str:
    """How validate mode names a request: its kind and op id."""
    return f"{kind} (op {request.request_metadata.op_id})"


def _refused_handle(what: str, handle: int) -> errors.InvalidRequest:
    if handle >= SERVER_HANDLE_BASE:
        return errors.InvalidRequest(
            f"{what} handle {handle} is in the range this server mints its own handles in "
            f"(from 2**62); a client mints its handles below {SERVER_HANDLE_BASE}, as the "
            "stock client does.")
    return errors.InvalidRequest(
        f"{what} handle {handle} is already in use in this session; mint a new handle for "
        f"each {what}.")


def _handles_in(body: Message, field: str) -> list[int]:
    value = getattr(body, field)
    if isinstance(value, int):
        return [value] if value else []
    return list(value)


def _answered(response: Message, kind: str) -> None:
    """Sets the response's oneof for a request of `kind` if its handler left it unset (an
    empty request's answer is an empty message, never no message: the client reads it)."""
    if response.WhichOneof("response") is None:
        getattr(response, kind[:-len("_request")] + "_response").SetInParent()
