"""The synchronous handlers ("sinks", `Method.sink`) of the IFRT service's calls that the
h2 transport serves as direct streams: an upload (`HostBufferStore`), a unary call, and the
session stream. Each takes its messages in the turn they arrive (`h2direct`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn, cast

import grpc

from isthmus import errors
from isthmus.frontend.message import Message
from isthmus.frontend.service import Frontend
from isthmus.protocol.wireformat import bytes_field_parts
from isthmus.wire.methods import Answer, CallContext, Pieces, Refused
from isthmus.wire.streams import END, drain

logger = logging.getLogger(__name__)

SESSION_METADATA_KEY = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA_KEY = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"


def grpc_status(code: errors.Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


class Upload:
    """One HostBufferStore call: its chunks are copied into the host buffer as they come.

    A buffer over the size limit is refused without failing the call: the request that
    uses it fails with the reason, and the session goes on (the stock client ends its whole
    session when an upload fails); its bytes are dropped."""

    __slots__ = ("store", "handle", "view", "size", "filled")

    def __init__(self, frontend: Frontend, context: CallContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.view: memoryview | None = None
        self.filled = 0
        try:
            header = frontend.parse_store_metadata(
                cast("bytes | None", metadata.get(STORE_METADATA_KEY)))  # "-bin": bytes
            self.handle = header.handle
            self.store = frontend.host_buffers(header.session_id,
                                               getattr(context, "identity", None))
            self.size = frontend.check_host_buffer_size(header.buffer_size)
            self.store.begin(header.handle, self.size)
        except errors.TooLarge as e:
            logger.info("refused host buffer upload: %s", e.message)
            self.store.abort(header.handle, e)
            return
        except errors.IsthmusError as e:
            logger.info("refused host buffer upload: %s", e.message)
            if getattr(self, "store", None) is not None:  # the array made of it fails now
                self.store.abort(header.handle, e)
            raise Refused(grpc_status(e.code), e.message) from None
        self.view = memoryview(frontend.upload_buffer(self.size))

    def message(self, chunk: bytes | memoryview | Pieces) -> None:
        if self.view is None:
            return  # refused for its size: dropped
        try:
            parts = bytes_field_parts(chunk)
        except ValueError:
            self._refuse(errors.InvalidRequest("a host buffer chunk is not a valid message."))
        view, filled = self.view, self.filled
        for data in parts:
            end = filled + len(data)
            if end > self.size:
                self._refuse(errors.InvalidRequest(
                    f"host buffer {self.handle} sent more than the {self.size} bytes its "
                    "metadata announced; send exactly buffer_size bytes."))
            view[filled:end] = data
            filled = end
        self.filled = filled
        self.store.progress(self.handle, filled)  # its bytes come: no deadline while they do

    def end(self) -> bytes:
        """The call's serialized response (an empty message)."""
        if self.view is not None:
            if self.filled != self.size:
                self._refuse(errors.InvalidRequest(
                    f"host buffer {self.handle} ended after {self.filled} of {self.size} "
                    "announced bytes; the upload was cut short."))
            self.store.complete(self.handle, self.view)
            self.view = None
        return b""

    def cancel(self, reason: BaseException | None) -> None:
        """The call broke off (the client reset it or went away)."""
        if self.view is not None:
            self.view = None
            logger.info("upload of host buffer %s broke off: %r", self.handle, reason)
            self.store.abort(self.handle, errors.HostBufferMissing(
                f"the upload of host buffer {self.handle} broke off "
                f"({type(reason).__name__}); retry the transfer."))

    def _refuse(self, error: errors.IsthmusError) -> NoReturn:
        self.view = None
        self.store.abort(self.handle, error)
        raise Refused(grpc_status(error.code), error.message)


class Unary:
    """A unary call as a sink (`Method.sink`): its one request, then `answer(request)`,
    whose `IsthmusError` becomes the call's status."""

    __slots__ = ("answer", "parse", "request")

    def __init__(self, answer: Callable[[Message], Answer],
                 parse: Callable[[bytes], Message]) -> None:
        self.answer, self.parse = answer, parse
        self.request: Message | None = None

    def message(self, message: memoryview | Pieces) -> None:
        if self.request is not None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "a unary call sent more than one request message")
        try:
            self.request = self.parse(bytes(message))
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "the request message is malformed") from None

    def end(self) -> Answer:
        if self.request is None:
            raise Refused(grpc.StatusCode.INTERNAL, "the call sent no request message")
        try:
            return self.answer(self.request)
        except errors.IsthmusError as e:
            raise Refused(grpc_status(e.code), e.message) from None

    def cancel(self, reason: BaseException | None) -> None:
        pass


class SessionStream:
    """One IfrtSession call: requests go to the session as they come, responses leave from
    its queue (`answer`), what is ready at once in one batch."""

    __slots__ = ("frontend", "session", "queue", "parse", "pace")

    def __init__(self, frontend: Frontend, context: CallContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.frontend = frontend
        # Responses, an error that ends the stream, or END (`streams.drain`).
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.parse = frontend.schema["xla.ifrt.proxy.IfrtRequest"].FromString
        try:
            self.session = frontend.open_session(
                cast("bytes | None", metadata.get(SESSION_METADATA_KEY)),  # "-bin": bytes
                self.queue.put_nowait, peer=context.peer(),
                identity=getattr(context, "identity", None))
        except errors.IsthmusError as e:
            raise Refused(grpc_status(e.code), e.message) from None
        # A shared service's tenant's rate, over all its sessions (`tenant_limits.Pace`).
        lease, shared = self.session.lease, self.session.shared_service
        self.pace = shared.limits(lease.tenant).pace if lease is not None else None

    def message(self, message: memoryview | Pieces) -> Awaitable[None] | None:
        try:
            request = self.parse(bytes(message))
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a request of session {self.session.id} is not an IfrtRequest; "
                          "the session ends (its arrays are released)") from None
        return self.handle(request)

    def handle(self, request: Message) -> Awaitable[None] | None:
        """Hands a request to the session; flow control: when a worker is far behind, or
        this session's uploads are, what to wait for before the next one."""
        self.session.handle(request)
        if self.pace is not None:
            delay = self.pace.spend()
            if delay > 0:  # the tenant is over its max_requests_per_second: it waits
                return asyncio.sleep(delay)
        flow = self.session.fleet.flow  # a lease's session: its own workers' backlogs only
        if not flow.is_open:
            return flow.wait()
        if not self.session.has_room:
            return self.session.wait_for_room()
        return None

    async def responses(self) -> AsyncIterator[object]:
        try:
            async for item in drain(self.queue):
                yield item
        except errors.IsthmusError as e:  # the session was ended (its lease ended)
            raise Refused(grpc_status(e.code), e.message) from None
        finally:
            await self.session.close()

    def end(self) -> None:
        self.queue.put_nowait(END)  # the client is done: the stream ends after its answers

    def cancel(self, reason: BaseException | None) -> None:
        self.queue.put_nowait(END)
