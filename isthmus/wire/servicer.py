"""The gRPC face of the server: `xla.ifrt.proxy.GrpcIfrtService` and our admin service.

With the two transports under it (grpc.aio, `h2server`), this is the layer that imports
grpc. It moves messages between the transport and the front end and maps `IsthmusError`s
to gRPC statuses for the RPCs that fail as a whole (the session stream reports per-request
errors inside its responses instead).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from isthmus import errors
from isthmus.frontend.message import Message
from isthmus.frontend.service import Frontend
from isthmus.protocol.wireformat import bytes_message
from isthmus.wire.methods import (
    MAX_MESSAGE,
    Answer,
    CallContext,
    Method,
    Pieces,
    Refused,
    flattened,
    joined,
)
from isthmus.wire.sinks import (
    SessionStream,
    Unary,
    Upload,
    grpc_status,
)

if TYPE_CHECKING:
    from isthmus.wire.gate import Gate
    from isthmus.wire.h2server import H2Server

logger = logging.getLogger(__name__)

SERVICE = "xla.ifrt.proxy.GrpcIfrtService"
ADMIN_SERVICE = "isthmus.Admin"
LOOKUP_CHUNK_BYTES = (4 << 20) - 64  # under gRPC's default 4 MiB message limit
DIRECT_LOOKUP_BYTES = 1 << 16  # a ready buffer up to this size is answered without a task

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # The client starts a host-buffer upload per shard, thousands at once for a pmap over
    # many arguments; grpc's default cancels calls beyond 1000 waiting for the handler
    # loop, and the client drops its whole session when an upload is cancelled.
    ("grpc.server.max_pending_requests", 1 << 20),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
    ("grpc.server_max_unrequested_time_in_server", 3600),
    ("grpc.so_reuseport", 0),
    # Keep idle sessions alive across NATs and notice dead clients.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Flow control: a session stream that is not read must soon block the client's writes.
    # gRPC grows a stream's receive window to the bandwidth-delay product, which let the
    # client queue thousands of requests (and start as many upload threads) ahead.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 1 << 16),
)



class IfrtProxyServicer:
    """Implements the IFRT proxy gRPC service on top of a `Frontend`."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.schema = frontend.schema

    async def get_version(self, request: Message, context: CallContext) -> Message:
        try:
            return self.frontend.get_version(request, getattr(context, "identity", None))
        except errors.IsthmusError as e:
            await context.abort(grpc_status(e.code), e.message)

    async def ifrt_session(self, requests: AsyncIterator[Message],
                           context: CallContext) -> AsyncIterator[object]:
        try:
            stream = self.session_stream(context)
        except Refused as e:
            await context.abort(e.code, e.message)
            return
        reader = asyncio.get_running_loop().create_task(self._read(requests, stream))
        try:
            async for item in stream.responses():
                yield item
        finally:
            reader.cancel()

    async def _read(self, requests: AsyncIterator[Message], stream: SessionStream) -> None:
        try:
            async for request in requests:
                wait = stream.handle(request)
                if wait is not None:
                    await wait
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken stream ends the session
            logger.info("session %s: request stream ended: %s", stream.session.id, e)
        stream.end()

    def session_stream(self, context: CallContext) -> SessionStream:
        """An IfrtSession call as a sink (see `Method.sink`); h2 feeds it directly."""
        return SessionStream(self.frontend, context)

    async def host_buffer_store(self, chunks: AsyncIterator[bytes | memoryview | Pieces],
                                context: CallContext) -> Message:
        try:
            upload = self.upload(context)
            try:
                async for chunk in chunks:
                    upload.message(chunk)
                upload.end()
            except BaseException as e:
                upload.cancel(e)
                raise
        except Refused as e:
            await context.abort(e.code, e.message)
            return
        return self.schema["xla.ifrt.proxy.GrpcHostBufferStoreResponse"]()

    def upload(self, context: CallContext) -> Upload:
        """A HostBufferStore call as a sink (see `Method.sink`); h2 feeds it directly."""
        return Upload(self.frontend, context)

    async def host_buffer_lookup(self, request: Message, context: CallContext
                                 ) -> AsyncIterator[bytes | Pieces]:
        try:
            store = self.frontend.host_buffers(request.session_id,
                                               getattr(context, "identity", None))
            data = await store.lookup(request.handle)
        except errors.IsthmusError as e:
            await context.abort(grpc_status(e.code), e.message)
            return
        if len(data) == 0:
            yield b""
            return
        for start in range(0, len(data), LOOKUP_CHUNK_BYTES):
            yield Pieces(bytes_message(data[start:start + LOOKUP_CHUNK_BYTES]))

    def lookup_now(self, request: Message, context: CallContext) -> Answer:
        """HostBufferLookup without a task when the buffer is ready and small: its
        serialized response; otherwise the streaming handler."""
        store = self.frontend.host_buffers(request.session_id,
                                           getattr(context, "identity", None))
        data = store.ready(request.handle)
        if data is None:
            coming = store.promised(request.handle)
            if coming is not None:  # the fetch is under way: answered the turn it lands
                return self._lookup_later(coming, request, context)
        if data is None or len(data) > DIRECT_LOOKUP_BYTES:
            return self.host_buffer_lookup(request, context)
        return b"".join(bytes_message(data)) if len(data) else b""

    def _lookup_later(self, coming: asyncio.Future[memoryview], request: Message,
                      context: CallContext) -> asyncio.Future[Answer]:
        """`lookup_now`'s answer for a buffer still on its way: a future of the serialized
        response (or, for a large one, of the streaming handler)."""
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

        def landed(_: object) -> None:
            if coming.cancelled():
                answer.set_exception(Refused(grpc.StatusCode.CANCELLED,
                                             "the fetch was cancelled; fetch the array again"))
                return
            error = coming.exception()
            if isinstance(error, errors.IsthmusError):
                answer.set_exception(Refused(grpc_status(error.code), error.message))
            elif error is not None or len(coming.result()) > DIRECT_LOOKUP_BYTES:
                answer.set_result(self.host_buffer_lookup(request, context))  # it reports
            else:
                data = coming.result()
                answer.set_result(b"".join(bytes_message(data)) if len(data) else b"")

        coming.add_done_callback(landed)
        return answer

    def delete_now(self, request: Message, context: CallContext) -> bytes:
        self.frontend.host_buffers(
            request.session_id, getattr(context, "identity", None)).delete(request.handle)
        return b""  # an empty GrpcHostBufferDeleteResponse

    async def host_buffer_delete(self, request: Message, context: CallContext
                                 ) -> Message:
        try:
            self.frontend.host_buffers(
                request.session_id, getattr(context, "identity", None)).delete(request.handle)
        except errors.IsthmusError as e:
            await context.abort(grpc_status(e.code), e.message)
        return self.schema["xla.ifrt.proxy.GrpcHostBufferDeleteResponse"]()

    async def host_buffer_read_from_disk(self, request: Message,
                                         context: CallContext) -> Message:
        header = self.frontend.parse_store_metadata(request.metadata.SerializeToString())
        try:
            store = self.frontend.host_buffers(header.session_id,
                                               getattr(context, "identity", None))
            store.begin(header.handle, self.frontend.check_host_buffer_size(
                header.buffer_size))
        except errors.IsthmusError as e:
            await context.abort(grpc_status(e.code), e.message)
            return
        try:
            # In a thread: mapping a large file's pages at once takes tens of ms.
            data = await asyncio.to_thread(self.frontend.read_shared, header)
        except errors.IsthmusError as e:
            store.abort(header.handle, e)
            await context.abort(grpc_status(e.code), e.message)
            return
        store.complete(header.handle, data)
        return self.schema["xla.ifrt.proxy.GrpcHostBufferReadFromDiskResponse"]()

    # ---- admin ---------------------------------------------------------------------------

    async def status(self, request: bytes, context: CallContext) -> bytes:
        try:
            buffer, array = _status_query(request)
            status = self.frontend.status(getattr(context, "identity", None),
                                          getattr(context, "local", True), buffer, array)
        except errors.IsthmusError as e:
            raise Refused(grpc_status(e.code), e.message) from None
        return json.dumps(status, sort_keys=True).encode()

    def methods(self) -> dict[str, Method]:
        """Every method of the client port, by path (for either transport)."""
        s = self.schema
        p = "xla.ifrt.proxy."

        def rpc(kind: str, fn: Callable[..., Answer], req: str | None, resp: str | None
                ) -> Method:
            return Method(kind, fn, s[p + req].FromString if req else None,
                          s[p + resp].SerializeToString if resp else None)

        # Bulk data skips protobuf objects: chunks are parsed and framed by hand (one
        # field, `bytes data = 1`), which saves a copy of every byte each way.
        ifrt = {
            "GetVersion": rpc("unary_unary", self.get_version, "GrpcGetVersionRequest",
                              "GrpcGetVersionResponse"),
            "IfrtSession": dataclasses.replace(
                rpc("stream_stream", self.ifrt_session, "IfrtRequest", "IfrtResponse"),
                sink=self.session_stream),
            "HostBufferStore": dataclasses.replace(
                rpc("stream_unary", self.host_buffer_store, None,
                    "GrpcHostBufferStoreResponse"), pieces=True, sink=self.upload),
            "HostBufferLookup": dataclasses.replace(
                rpc("unary_stream", self.host_buffer_lookup, "GrpcHostBufferLookupRequest",
                    None),
                sink=lambda context: Unary(lambda r: self.lookup_now(r, context),
                                            s[p + "GrpcHostBufferLookupRequest"].FromString)),
            "HostBufferDelete": dataclasses.replace(
                rpc("unary_unary", self.host_buffer_delete, "GrpcHostBufferDeleteRequest",
                    "GrpcHostBufferDeleteResponse"),
                sink=lambda context: Unary(lambda r: self.delete_now(r, context),
                                            s[p + "GrpcHostBufferDeleteRequest"].FromString)),
            "HostBufferReadFromDisk": rpc("unary_unary", self.host_buffer_read_from_disk,
                                          "GrpcHostBufferReadFromDiskRequest",
                                          "GrpcHostBufferReadFromDiskResponse"),
        }
        return {**{f"/{SERVICE}/{name}": m for name, m in ifrt.items()},
                f"/{ADMIN_SERVICE}/Status": Method("unary_unary", self.status)}


def grpc_handlers(methods: dict[str, Method]) -> list[grpc.GenericRpcHandler]:
    """`Method`s as grpcio generic handlers, one per service."""
    kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler,
             "unary_stream": grpc.unary_stream_rpc_method_handler,
             "stream_unary": grpc.stream_unary_rpc_method_handler,
             "stream_stream": grpc.stream_stream_rpc_method_handler}
    services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for path, m in methods.items():
        service, _, name = path.lstrip("/").partition("/")
        fn = flattened(m.fn) if m.kind.endswith("stream") else m.fn
        services.setdefault(service, {})[name] = kinds[m.kind](
            fn, request_deserializer=m.deserialize, response_serializer=joined(m.serialize))
    return [grpc.method_handlers_generic_handler(service, table)
            for service, table in services.items()]


def _probe(host: str, port: int) -> bool:
    """False when `port` (not 0) on `host` cannot be bound now."""
    import socket

    if port == 0:
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


class CannotListen(OSError):
    """A server port could not be bound (a bad option or environment: the user picks another)."""


async def start_server(frontend: Frontend, host: str, port: int | None,
                       extra_methods: dict[str, Method] | None = None,
                       transport: str = "grpc", gate: Gate | None = None,
                       unix_path: str | None = None,
                       max_message: int = MAX_MESSAGE
                       ) -> tuple[H2Server | grpc.aio.Server, int]:
    """Starts serving; returns the server and the port it bound (for port 0, a free one;
    None: no TCP port, only `unix_path`, and 0 is returned).

    `extra_methods` (the fleet service workers connect to) share the port. `transport`:
    "h2" (`wire/h2server.py`), "grpc" (grpc.aio) or "auto" (h2 when it is installed). A
    shared service's `gate` (`wire/gate.py`) needs h2. `unix_path`: a Unix socket served too
    (mode 0600: only this user may connect), for a shared service's tunnels or, without a
    gate, the plain client port. A request message over `max_message` bytes fails its call
    with RESOURCE_EXHAUSTED."""
    methods = {**IfrtProxyServicer(frontend).methods(), **(extra_methods or {})}
    if gate is not None:
        transport = "h2"
    if transport == "auto":
        try:
            import h2  # noqa: F401
        except ImportError:
            logger.info("the h2 library is not installed: the client port is served by "
                        "grpc.aio (pip install h2 for less CPU per request)")
            transport = "grpc"
        else:
            transport = "h2"
    cannot = CannotListen(f"cannot listen on {host}:{port}: the port is in use or the address "
                          "is not this machine's; pick another --port (0: a free one) or "
                          "--host")
    if transport == "h2":
        from isthmus.wire.h2server import H2Server

        h2_server = H2Server(methods, gate, max_message)
        bound = 0
        try:
            if port is not None:
                bound = await h2_server.start(host, port)
        except OSError:
            raise cannot from None
        if unix_path is not None:
            try:
                await h2_server.start_unix(unix_path)
            except OSError as e:
                await h2_server.stop()
                raise CannotListen(f"cannot serve the Unix socket {unix_path}: "
                                   f"{e.strerror or e}; pick another --unix-socket") from None
        return h2_server, bound
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", min(max_message, (1 << 31) - 1)))
    server = grpc.aio.server(options=options)  # grpc's limit is a C int
    server.add_generic_rpc_handlers(grpc_handlers(methods))
    bound = 0
    if port is not None:
        try:
            # A port that is taken fails here, before gRPC logs its own error line about it.
            bound = _probe(host, port) and server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpcio >= 1.6x raises where older ones returned 0
            bound = 0
        if bound == 0:
            raise cannot
    if unix_path is not None:
        import os

        old = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{unix_path}")
        except RuntimeError as e:
            raise CannotListen(f"cannot serve the Unix socket {unix_path}: {e}; pick another "
                               "--unix-socket") from None
        finally:
            os.umask(old)
    await server.start()
    return server, bound


def _status_query(request: bytes) -> tuple[int | None, tuple[int, int] | None]:
    """A Status request's body: empty (the whole status), or a JSON object naming a buffer
    ({"buffer": 17}) or an array ({"array": [SESSION, HANDLE]}) whose moves to show."""
    try:
        query = json.loads(request) if request else {}
    except ValueError:
        query = None
    if not isinstance(query, dict):
        raise errors.InvalidRequest("a status query is empty, or a JSON object such as "
                                    '{"buffer": 17} or {"array": [1, 5]}')
    buffer, array = query.get("buffer"), query.get("array")
    if buffer is not None and (type(buffer) is not int or buffer < 0):
        raise errors.InvalidRequest(f"a status query's buffer must be a buffer id (a "
                                    f"non-negative integer), not {buffer!r}")
    if array is not None:
        if (not isinstance(array, list) or len(array) != 2
                or not all(type(n) is int and n >= 0 for n in array)):
            raise errors.InvalidRequest(f"a status query's array is [SESSION, HANDLE] (two "
                                        f"non-negative integers), not {array!r}")
        return buffer, (array[0], array[1])
    return buffer, None


def status_query(buffer: int | None = None, array: tuple[int, int] | None = None) -> bytes:
    """The body of a Status request (`_status_query` reads it)."""
    if array is not None:
        return json.dumps({"array": list(array)}).encode()
    return json.dumps({"buffer": buffer}).encode() if buffer is not None else b""


def fetch_status(address: str, timeout: float = 10.0, buffer: int | None = None,
                 array: tuple[int, int] | None = None) -> dict[str, Any]:
    """Asks a running server for its status (used by `isthmus status`); with `buffer` (or
    `array`: session id, handle), that buffer's (the array's buffers') last moves."""
    target = address.removeprefix("grpc://")
    query = status_query(buffer, array)
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/{ADMIN_SERVICE}/Status")
        return json.loads(call(query, timeout=timeout))
