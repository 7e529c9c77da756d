"""The front end: version negotiation, sessions, and routing of host-buffer RPCs.

It sits between the gRPC servicer (which only moves messages) and the controller (which knows
nothing of the protocol). Sessions dispatch requests on the table of frontend/registry.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from isthmus import errors
from isthmus.controller.controller import Controller
from isthmus.controller.session import Session as ControllerSession
from isthmus.frontend.host_buffers import HostBufferStore, map_shared_file
from isthmus.frontend.lease_service import Identity, SharedService
from isthmus.frontend.message import Message
from isthmus.frontend.programs import CompileOptionsVetter
from isthmus.frontend.registry import HANDLERS
from isthmus.frontend.serdes import Serdes
from isthmus.frontend.session import FrontendSession, Platform, Send
from isthmus.hostmem import aligned_empty, shared_empty
from isthmus.ids import HostBufferHandle, SessionId
from isthmus.protocol import versions
from isthmus.protocol.schema import Schema
from isthmus.transport.remote import SHARED_BYTES

logger = logging.getLogger(__name__)

SMALL_UPLOAD = 64 << 10  # uploads below this are received into plain (unaligned) memory


@dataclasses.dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Protocol-facing limits."""

    max_host_buffer_bytes: int = 1 << 40  # larger uploads are refused
    platform_version: str = "isthmus"
    # Where clients on this machine may drop large host buffers (HostBufferReadFromDisk);
    # None: that transfer path is off.
    shared_dir: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StoreHeader:
    session_id: int
    handle: HostBufferHandle
    buffer_size: int


class Frontend:
    """Sessions of the IFRT proxy protocol over one controller."""

    def __init__(self, controller: Controller, schema: Schema,
                 config: FrontendConfig | None = None) -> None:
        self.controller = controller
        self.schema = schema
        self.config = config or FrontendConfig()
        self.serdes = Serdes(schema)
        self.vetter = CompileOptionsVetter(schema)
        self.sessions: dict[SessionId, FrontendSession] = {}
        self.handlers = HANDLERS  # the table its sessions dispatch requests on
        self._session_ids = itertools.count(1)
        self.extra_status: Callable[[], dict[str, Any]] | None = None
        # A shared service's leases (None: whoever reaches the port uses every device).
        self.shared: SharedService | None = None
        # Open while the workers keep up; sessions read no new requests while it is closed.
        self.flow = controller.fleet.flow
        self._version_response = schema["xla.ifrt.proxy.GrpcGetVersionResponse"]
        self._session_metadata = schema["xla.ifrt.proxy.GrpcIfrtSessionMetadata"]
        self._store_metadata = schema["xla.ifrt.proxy.GrpcHostBufferStoreMetadata"]

    @property
    def platform(self) -> Platform:
        """The platform sessions report; a fleet's is known once its first worker registered."""
        name = self.controller.fleet.platform
        return {"name": name, "version": self.config.platform_version,
                "id": _platform_id(name), "runtime_type": "proxy/isthmus"}

    @staticmethod
    def implemented_requests() -> list[str]:
        return sorted(HANDLERS)

    def get_version(self, request: Message, identity: Identity | None = None) -> Message:
        if self.shared is not None:
            self.shared.lease_of(identity)  # a stranger learns nothing, not even versions
        low, high = request.min_version, request.max_version
        version = versions.negotiate(
            low.protocol_version, high.protocol_version, high.ifrt_serdes_version_number,
            low.ifrt_serdes_version_number)
        logger.info("a client of %s connects (protocol %s..%s)", versions.client_jaxlib(
            low.ifrt_serdes_version_number, high.ifrt_serdes_version_number),
            low.protocol_version, high.protocol_version)
        response = self._version_response()
        response.version.protocol_version = version.protocol
        response.version.ifrt_serdes_version_number = version.serdes
        return response

    def open_session(self, metadata: bytes | None, send: Send, peer: str = "",
                     identity: Identity | None = None) -> FrontendSession:
        lease = None
        if self.shared is not None:
            lease = self.shared.lease_of(identity)
        if metadata is None:
            raise errors.InvalidRequest(
                "the session carries no ifrt-proxy-grpc-ifrt-session-metadata-bin header; "
                "connect with jax's IFRT proxy client.")
        try:
            parsed = self._session_metadata.FromString(metadata)
        except Exception:  # noqa: BLE001
            raise errors.InvalidRequest("the session metadata does not parse.") from None
        version = versions.negotiate(
            parsed.version.protocol_version, parsed.version.protocol_version,
            parsed.version.ifrt_serdes_version_number)
        session_id = SessionId(next(self._session_ids))
        if lease is not None:
            assert self.shared is not None
            controller_session = ControllerSession(
                self.controller, self.shared.view(lease), lease.tenant.name,
                files=self.shared.files(lease),
                python_refusal=self.shared.colocated_refusal(lease.tenant))
        else:
            controller_session = ControllerSession(self.controller)
        budget = self.shared.limits(lease.tenant).uploads if (
            self.shared is not None and lease is not None) else None
        session = FrontendSession(
            session_id, version, self.schema, self.serdes, self.handlers, controller_session,
            HostBufferStore(self.controller.config.host_buffer_timeout, budget), send,
            self.platform, self.vetter, peer, on_close=self._closed)
        session.lease, session.shared_service = lease, self.shared
        if lease is not None:
            SharedService.sessions(lease).add(session)
        self.sessions[session_id] = session
        logger.info("session %s opened from %s (protocol %s)", session_id, peer,
                    version.protocol)
        return session

    def _closed(self, session: FrontendSession) -> None:
        self.sessions.pop(session.id, None)
        if session.lease is not None:
            SharedService.sessions(session.lease).discard(session)
        logger.info("session %s closed after %s requests", session.id, session.requests)

    def parse_store_metadata(self, metadata: bytes | None) -> StoreHeader:
        if metadata is None:
            raise errors.InvalidRequest(
                "HostBufferStore needs the ifrt-proxy-grpc-host-buffer-store-metadata-bin "
                "header.")
        try:
            parsed = self._store_metadata.FromString(metadata)
        except Exception:  # noqa: BLE001
            raise errors.InvalidRequest("the host buffer metadata does not parse.") from None
        return StoreHeader(parsed.session_id, HostBufferHandle(parsed.handle),
                           parsed.buffer_size)

    def upload_buffer(self, size: int) -> np.ndarray:
        """Where an upload of `size` bytes is received: a file of the shared directory when
        a worker on this machine takes its data through files there (its put then links the
        file instead of writing one), else anonymous memory."""
        directory = self.config.shared_dir
        if directory is not None and size >= SHARED_BYTES and any(
                getattr(channel, "shared_dir", None)
                for channel in self.controller.fleet.workers.values()):
            buffer = shared_empty(directory, size)
            if buffer is not None:
                return buffer
        if size < SMALL_UPLOAD:
            return np.empty(size, np.uint8)  # copied where it goes anyway: no alignment
        return aligned_empty(size)

    def check_host_buffer_size(self, size: int) -> int:
        if size < 0:
            raise errors.InvalidRequest(f"a host buffer cannot have {size} bytes.")
        if size > self.config.max_host_buffer_bytes:
            raise errors.TooLarge(
                f"a host buffer of {size} bytes is over the server's limit of "
                f"{self.config.max_host_buffer_bytes}; split the transfer.")
        return size

    def read_shared(self, header: StoreHeader) -> memoryview:
        """A host buffer the client wrote into the shared directory (blocking: its pages
        are mapped at once for an accelerator fleet, `map_shared_file`)."""
        if self.config.shared_dir is None:
            raise errors.Unimplemented(
                "this server has no shared directory for host buffers; unset "
                "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES in the client "
                "(or start the server with --shared-dir).")
        fleet = self.controller.fleet
        return map_shared_file(self.config.shared_dir, header.handle,
                               self.check_host_buffer_size(header.buffer_size),
                               populate=fleet.platform != "cpu",
                               keep=any(not w.local for w in fleet.workers.values()))

    def host_buffers(self, session_id: int, identity: Identity | None = None
                     ) -> HostBufferStore:
        """The host buffers of a session; on a shared service, only of the caller's lease."""
        session = self.sessions.get(SessionId(session_id))
        if session is not None and self.shared is not None and (
                session.lease is None or getattr(identity, "lease_id", None) != session.lease.id):
            session = None  # another tenant's (or lease's) session is not there for it
        if session is None:
            raise errors.UnknownHandle(
                f"session {session_id} is not open on this server; host buffers belong to a "
                "live session.")
        return session.host_buffers

    def status(self, identity: Identity | None = None, local: bool = True,
               buffer: int | None = None, array: tuple[int, int] | None = None
               ) -> dict[str, Any]:
        """The fleet, its sessions and arrays; with `buffer`, that buffer's last moves and
        what caused them instead (with `array`, (session id, array handle): those of the
        array's buffers). On a shared service only an admin's tunnel sees sessions,
        buffers and memory figures (they are other tenants'); a tenant, or a caller on the
        service's own machine (`local`), sees the fleet's health and the service's aggregate
        figures; a stranger elsewhere, that a credential is needed."""
        if self.shared is not None and identity is None and not local:
            raise errors.Unauthenticated(
                "this shared service tells its status to its tenants and admins only: run "
                "isthmus status --controller HOST:PORT --token-file FILE --service-ca PEM "
                "with a tenant's (an admin's, for everything) token, or on the service's "
                "own machine.")
        admin = self.shared is None or getattr(getattr(identity, "tenant", None), "admin",
                                                   False)
        if buffer is not None or array is not None:
            if not admin:
                raise errors.NotPermitted(
                    "a buffer's moves are shown to the shared service's admins only: run "
                    "isthmus status --buffer or --array with an admin's token.")
            if array is not None:
                return self._array_status(*array)
            assert buffer is not None
            return self._buffer_status(buffer)
        status = self._status()
        if not admin:
            status["sessions_open"] = len(status.pop("sessions"))
            status["workers"] = {slot: {} for slot in status["workers"]}
            status["redacted"] = "sessions and memory figures are for the service's admins"
        return status

    def _array_status(self, session_id: int, handle: int) -> dict[str, Any]:
        session = self.sessions.get(SessionId(session_id))
        if session is None:
            raise errors.UnknownHandle(f"there is no open session {session_id}; isthmus "
                                       "status lists the open sessions.")
        array = session.arrays.get(handle)
        if array is None:
            raise errors.UnknownHandle(f"session {session_id} has no array handle {handle}.")
        if isinstance(array, errors.IsthmusError):
            return {"session": session_id, "array": handle, "error": array.message,
                    "buffers": []}
        return {"session": session_id, "array": handle, "state": array.state.value,
                "buffers": [self._buffer_status(int(b.id)) for b in array.shards]}

    def _buffer_status(self, buffer: int) -> dict[str, Any]:
        ledger = self.controller.ledger
        transitions = ledger.transitions
        return {"buffer": buffer, "transitions": transitions.of(buffer),
                "kept": len(transitions), "state": ledger.state_of(buffer)}

    def _status(self) -> dict[str, Any]:
        fleet = self.controller.fleet
        return {
            "platform": self.platform,
            "server_jax": _jax_version(),
            "shared_dir": self.config.shared_dir,
            "generation": fleet.generation,
            "flow": {"open": fleet.flow.is_open, "closed_count": fleet.flow.closed_count},
            "slices_down": {str(s): e.message for s, e in fleet.down_slices.items()},
            "fleet": self.extra_status() if self.extra_status else {},
            "devices": [{"id": d.id, "worker": d.worker, "slice": d.slice_index,
                         "host": d.host_index, "kind": d.kind} for d in fleet.devices],
            "sessions": {str(s.id): {"peer": s.peer, "requests": s.requests,
                                     "arrays": len(s.arrays),
                                     "host_buffer_bytes": s.host_buffers.bytes_held}
                         for s in self.sessions.values()},
            **self.controller.stats(),
            # A shared service's figures only: tenants and leases are for admins (leases).
            **({"shared": self.shared.figures()} if self.shared is not None else {}),
        }

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.close()


def _jax_version() -> str:
    import jax

    return jax.__version__


def _platform_id(name: str) -> int:
    # jaxlib's platform ids are fingerprints of the name; only equality matters to clients.
    import zlib

    return zlib.crc32(name.encode())
