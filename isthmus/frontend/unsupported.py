"""Requests for features isthmus does not offer, answered so the client moves on.

Host callbacks cannot reach the server from the stock OSS client (it refuses them before
compiling), and isthmus never reports an executable as MPMD. These handlers answer the way
the client copes with best.

Kinds that newer jaxlibs add for protocol versions above the ones isthmus speaks (jaxlib
0.12.1: hash values, cancel an execution, deserialize an executable) are refused in words: a
client sends them only at the version that introduced them, which isthmus never answers in
`GetVersion`, so one that arrives comes from a client that did not follow the negotiation.
"""

from __future__ import annotations

from isthmus import errors
from isthmus.frontend.message import Message
from isthmus.frontend.session import FrontendSession, Handler
from isthmus.protocol import versions


def host_callback_poll(session: FrontendSession, request: Message, response: Message) -> None:
    # An empty answer tells the client the callback is retired: it stops polling.
    response.loaded_host_callback_poll_response.SetInParent()


def host_callback_return(session: FrontendSession, request: Message, response: Message) -> None:
    handle = request.loaded_host_callback_return_request.host_callback_execution_handle
    raise errors.UnknownHandle(
        f"host callback execution {handle} is unknown: isthmus runs no host callbacks.")


def _not_mpmd(session: FrontendSession, handle: int) -> errors.IsthmusError:
    session.executable(handle)  # unknown handles fail as such
    return errors.InvalidRequest(
        "the executable is not an MPMD executable; isthmus compiles SPMD programs only.")


def mpmd_metadata(session: FrontendSession, request: Message, response: Message) -> None:
    error = _not_mpmd(
        session, request.loaded_executable_mpmd_metadata_request.mpmd_loaded_executable_handle)
    out = response.loaded_executable_mpmd_metadata_response.mpmd_compiled_memory_stats_error
    out.code = int(error.code)
    out.message = error.message


def mpmd_cost_analysis(session: FrontendSession, request: Message, response: Message) -> None:
    raise _not_mpmd(
        session, request.loaded_executable_mpmd_cost_analysis_request.loaded_executable_handle)


def newer_protocol(what: str) -> Handler:
    """The handler of a request kind of a protocol version above isthmus's."""

    def refuse(session: FrontendSession, request: Message, response: Message) -> None:
        raise errors.Unimplemented(
            f"{what} comes with an IFRT proxy protocol version above "
            f"{versions.MAX_PROTOCOL_VERSION}, the highest isthmus speaks; this session "
            f"negotiated version {session.version.protocol}, at which the client does not "
            "send it. Use the stock jax client, which keeps to the version it negotiated.")

    return refuse
