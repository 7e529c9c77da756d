"""Errors of isthmus, each with the status code the user's process sees.

    IsthmusError                    base; `code` is the gRPC/absl status code
    +-- RequestError                the request itself is wrong
    |   +-- InvalidRequest          INVALID_ARGUMENT: malformed, absurd shapes, bad dtypes
    |   +-- UnknownHandle           NOT_FOUND: a handle this session never made (or freed)
    |   +-- ArrayDeleted            FAILED_PRECONDITION: the array was deleted or donated
    |   +-- Unimplemented           UNIMPLEMENTED: a request kind isthmus does not serve
    |   +-- VersionMismatch         FAILED_PRECONDITION: no protocol version both sides speak
    |   +-- TooLarge                RESOURCE_EXHAUSTED: over a configured limit
    |   +-- ProfileRunning          FAILED_PRECONDITION: another profile of the fleet runs
    +-- HostBufferMissing           DEADLINE_EXCEEDED: host data never arrived
    +-- ServiceRefusal              a shared service turned the client away
    |   +-- Unauthenticated         UNAUTHENTICATED: no identity, or a wrong one
    |   +-- NotPermitted            PERMISSION_DENIED: the tenant may not do this
    |   +-- OverQuota               RESOURCE_EXHAUSTED: more slices than the tenant's quota
    |   +-- NoCapacity              RESOURCE_EXHAUSTED: nothing free and no wait asked for
    |   +-- LeaseEnded              FAILED_PRECONDITION: the lease expired, was revoked or lost
    +-- ProgramError                INVALID_ARGUMENT: the user's program failed (kept apart
    |   |                           from system faults)
    |   +-- CompileError            INVALID_ARGUMENT: the program does not parse or compile
    |   +-- ExecutionError          INTERNAL: the program failed while running
    |   +-- ProgramRefused          FAILED_PRECONDITION: it crashed a worker; not run again
    |   +-- UserCodeError           UNKNOWN: a colocated Python function raised
    +-- SystemFault                 INTERNAL: isthmus or its fleet failed, not the user's program
        +-- WorkerLost              DATA_LOSS: a worker (host) of the fleet went away
        |   +-- SliceReclaimed      DATA_LOSS: a higher priority took an elastic lease's slice
        |   +-- PeerFailure         DATA_LOSS: a collective's transport lost a peer (gloo, NCCL)
        +-- SessionClosed           CANCELLED: the session ended while work was pending
        +-- InternalError           INTERNAL: a bug in isthmus; please report it
            +-- IllegalTransition   the ledger refused a move of a shard or an array
            |                       (controller/groups.py)
            +-- IllegalMove         a worker's membership refused a move (worker/membership.py)

    PlatformUnavailable (worker/platforms.py) is a worker's own: its platform cannot start,
    and the process exits with a code that says so; it never reaches a client.

Each error's message names the cause and ends with what the user can do next. Translation to
a wire status happens once, in the front end (`frontend.status`). tests/unit/test_exports.py
checks that this tree names every error class of the package.
"""

from __future__ import annotations

import enum
import re


class Code(enum.IntEnum):
    """Canonical status codes (numbering shared by gRPC, absl and tensorflow.error.Code)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class IsthmusError(Exception):
    """Base of every error isthmus reports; `code` says how it travels on the wire."""

    code: Code = Code.UNKNOWN

    def __init__(self, message: str, *, code: Code | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class RequestError(IsthmusError):
    """The request is wrong; resending it unchanged fails the same way."""

    code = Code.INVALID_ARGUMENT


class InvalidRequest(RequestError):
    code = Code.INVALID_ARGUMENT


class UnknownHandle(RequestError):
    code = Code.NOT_FOUND


class ArrayDeleted(RequestError):
    code = Code.FAILED_PRECONDITION


class Unimplemented(RequestError):
    code = Code.UNIMPLEMENTED


class VersionMismatch(RequestError):
    code = Code.FAILED_PRECONDITION


class TooLarge(RequestError):
    code = Code.RESOURCE_EXHAUSTED


class ProfileRunning(RequestError):
    code = Code.FAILED_PRECONDITION


class HostBufferMissing(IsthmusError):
    code = Code.DEADLINE_EXCEEDED


class ServiceRefusal(IsthmusError):
    """A shared service turned the client away (identity, quota, capacity, lease)."""

    code = Code.PERMISSION_DENIED


class Unauthenticated(ServiceRefusal):
    code = Code.UNAUTHENTICATED


class NotPermitted(ServiceRefusal):
    code = Code.PERMISSION_DENIED


class OverQuota(ServiceRefusal):
    code = Code.RESOURCE_EXHAUSTED


class NoCapacity(ServiceRefusal):
    code = Code.RESOURCE_EXHAUSTED


class LeaseEnded(ServiceRefusal):
    code = Code.FAILED_PRECONDITION


class ProgramError(IsthmusError):
    """The user's program failed; isthmus itself is fine."""

    code = Code.INVALID_ARGUMENT


class CompileError(ProgramError):
    code = Code.INVALID_ARGUMENT


class ExecutionError(ProgramError):
    code = Code.INTERNAL


class ProgramRefused(ProgramError):
    """The program crashed a worker process once (a fatal signal while it was dispatched);
    this controller refuses to compile or run it again."""

    code = Code.FAILED_PRECONDITION


class UserCodeError(ProgramError):
    """User Python code (a colocated Python function) raised an exception."""

    code = Code.UNKNOWN


class SystemFault(IsthmusError):
    """isthmus or its fleet failed; the user's program may be fine."""

    code = Code.INTERNAL


class WorkerLost(SystemFault):
    code = Code.DATA_LOSS


class SliceReclaimed(WorkerLost):
    """A higher-priority lease took a slice of an elastic lease; it comes back when free."""


class PeerFailure(WorkerLost):
    """A collective's transport (gloo, NCCL) failed: a peer of the group went away. The worker
    names the lost worker once the controller has said which (`FormGroup.reason`)."""


# What XLA's collective transports say when a peer process vanished mid-collective.
_PEER_FAILURE = re.compile(
    r"Gloo [a-z-]+ failed|Connection reset by peer|Connection closed by peer|Broken pipe|"
    r"[Rr]ead error|[Ww]rite error|NCCL (?:operation|error)|ncclRemoteError|ncclSystemError")


def is_peer_failure(text: str) -> bool:
    return _PEER_FAILURE.search(text) is not None


class SessionClosed(SystemFault):
    code = Code.CANCELLED


class InternalError(SystemFault):
    code = Code.INTERNAL


_STATUS_PREFIX = re.compile(r"^([A-Z_]+): ")


def from_runtime_error(exc: BaseException, cls: type[IsthmusError], context: str) -> IsthmusError:
    """Wraps an exception raised by jaxlib, keeping the status code its message carries.

    jaxlib raises `JaxRuntimeError("INVALID_ARGUMENT: ...")`; the code prefix is kept as
    the status code so the user sees what XLA said, prefixed by what isthmus was doing.
    """
    if isinstance(exc, IsthmusError):
        return exc
    text = str(exc) or type(exc).__name__
    code = cls.code
    match = _STATUS_PREFIX.match(text)
    if match and match.group(1) in Code.__members__:
        code = Code[match.group(1)]
        text = text[match.end():]
    return cls(f"{context}: {text}", code=code)
