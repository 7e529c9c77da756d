"""The worker's network links: its control stream to the controller, its pulse, and its
peer data server.

Peers move shard bytes worker to worker (`isthmus.WorkerData/Fetch`), never through the
controller. A fetched buffer travels as one encoded header followed by raw byte pieces.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypedDict, cast

import grpc
import grpc.aio
import numpy as np

from isthmus import errors
from isthmus.hostmem import byte_view
from isthmus.ids import BufferId
from isthmus.transport import auth
from isthmus.transport import messages as m
from isthmus.transport.frames import (
    FrameStream,
    Parts,
    StreamClosed,
    connect,
    connect_unix,
    keep_alive,
    read_frame,
    write_frames,
)
from isthmus.transport.tls import FLEET_NAME, GRPC_NAME_OPTION, TlsConfig

logger = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20
MAC_KEY = "isthmus-mac-bin"  # gRPC metadata of a peer data request (binary: "-bin")
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


class _PeerHeader(TypedDict, total=False):
    """What a peer data server sends first: an error, a string array, or the layout of the
    raw bytes that follow."""

    error: errors.IsthmusError
    objects: np.ndarray
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ControllerLink:
    """The worker's control stream to the controller (`transport/frames.py`)."""

    def __init__(self, address: str, token: str = "", tls: TlsConfig | None = None) -> None:
        self.address = address.removeprefix("grpc://")
        self.token = token  # the fleet's (`transport/auth.py`)
        self.tls = tls  # mutual TLS on the stream (`transport/tls.py`), or None
        self._stream: FrameStream | None = None
        self._out: list[bytes | Parts] = []  # frames of this turn, not yet written

    async def open(self, first: m.Register, timeout: float) -> AsyncIterator[object]:
        """Proves this worker to the controller (and the controller to it), sends `first`,
        then yields the controller's messages until the stream ends. Waits up to `timeout`
        for the controller to be up; raises `auth.Unauthenticated` on a token mismatch."""
        host = self.address.rpartition(":")[0].strip("[]")
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            endpoint = channel.unary_unary("/isthmus.Fleet/Endpoint")
            where = (await endpoint(b"", timeout=timeout, wait_for_ready=True)).decode()
        context = None if self.tls is None else self.tls.client_context()
        try:
            if where.startswith("unix:"):  # a fleet on one machine without TCP
                opening = connect_unix(where.removeprefix("unix:"))
            else:
                opening = connect(host, int(where), context,
                                  FLEET_NAME if context is not None else None)
            self._stream = await asyncio.wait_for(opening, timeout)
        except ssl.SSLError as e:
            raise auth.Unauthenticated(
                f"the TLS handshake with the controller failed ({e.reason or e}); give the "
                "controller and the workers certificates of the same fleet CA") from None
        keep_alive(self._stream)
        try:
            await auth.prove_worker(self._stream, self._stream, self.token)
        except auth.Unauthenticated as e:
            if self.tls is not None or "closed" not in str(e):
                raise
            raise auth.Unauthenticated(
                f"{e}: a controller that requires TLS closes the stream of a worker "
                "without it (give --tls-cert, --tls-key and --tls-ca)") from None
        self.send(first)
        return self._messages()

    async def _messages(self) -> AsyncIterator[object]:
        assert self._stream is not None
        while True:
            try:
                frame = await read_frame(self._stream)
            except StreamClosed:
                return
            yield m.decode(frame)

    def send(self, message: object) -> None:
        """Sends at the end of this turn, with whatever else is sent in it (the answers of a
        batch of commands leave in one write, not one each)."""
        if self._stream is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(m.encode(message))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._stream is not None:
            write_frames(self._stream, out)

    async def close(self) -> None:
        if self._stream is not None:
            self._flush()
            self._stream.close()
            try:
                await asyncio.wait_for(self._stream.wait_closed(), 2.0)
            except (TimeoutError, ConnectionError, OSError):
                pass


class PeerDataServer:
    """Serves this worker's buffers to its peers."""

    def __init__(self, fetch: Callable[[BufferId], Awaitable[np.ndarray]],
                 tls: TlsConfig | None = None) -> None:
        self._fetch = fetch
        # The controller's key for this membership (`Welcome.data_key`); until then a random
        # one that nobody knows.
        self.key = secrets.token_hex(32)
        self._tls = tls
        self._server: grpc.aio.Server | None = None

    async def start(self, listen: str, advertise: str | None = None) -> str:
        """Serves on `listen` (a host: a free port there; unix:DIR: a fresh Unix socket in
        DIR, mode 0600); returns the address peers reach it at (gRPC's form: HOST:PORT, with
        `advertise` for the host, or unix:PATH)."""
        self._server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "isthmus.WorkerData", {"Fetch": grpc.unary_stream_rpc_method_handler(self._serve)})])
        if listen.startswith("unix:"):
            target = (f"unix:{listen.removeprefix('unix:').rstrip('/')}/"
                      f"data-{os.getpid()}-{secrets.token_hex(4)}.sock")
            old = os.umask(0o177)
            try:
                self._add_port(target)
            finally:
                os.umask(old)
            await self._server.start()
            return target
        port = self._add_port(f"{listen}:0")
        await self._server.start()
        return f"{advertise or listen}:{port}"

    def _add_port(self, target: str) -> int:
        assert self._server is not None
        if self._tls is not None:
            return self._server.add_secure_port(target, self._tls.grpc_server_credentials())
        return self._server.add_insecure_port(target)

    async def _serve(self, request: bytes, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[bytes]:
        buffer_id = BufferId(int(request.decode()))
        mac = dict(context.invocation_metadata()).get(MAC_KEY)
        if not isinstance(mac, bytes) or not auth.fetch_allowed(self.key, buffer_id, mac):
            logger.warning("refused a buffer request from %s: no valid HMAC from the "
                           "controller for that buffer", context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "no valid HMAC from the controller for that buffer")
            return
        # These messages hold no Bulk bytes: each encodes to one bytes object.
        try:
            value = await self._fetch(buffer_id)
        except errors.IsthmusError as e:
            yield cast(bytes, m.encode({"error": e}))
            return
        if value.dtype == object:
            yield cast(bytes, m.encode({"objects": value}))
            return
        flat = byte_view(value)
        yield cast(bytes, m.encode({"dtype": m.dtype_name(value.dtype), "shape": value.shape,
                                    "nbytes": flat.nbytes}))
        for start in range(0, flat.nbytes, PIECE_BYTES):
            yield flat[start:start + PIECE_BYTES].tobytes()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)


class PeerClient:
    """Fetches buffers from other workers' data servers."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def fetch(self, peer: str, buffer_id: int, mac: bytes,
                    timeout: float = 600.0) -> np.ndarray:
        """Buffer `buffer_id` of the worker at `peer`; `mac` is the controller's for it."""
        channel = self._channels.get(peer)
        if channel is None:
            channel = (grpc.aio.insecure_channel(peer, options=CHANNEL_OPTIONS)
                       if self._tls is None else grpc.aio.secure_channel(
                           peer, self._tls.grpc_channel_credentials(),
                           options=CHANNEL_OPTIONS + GRPC_NAME_OPTION))
            self._channels[peer] = channel
        call = channel.unary_stream("/isthmus.WorkerData/Fetch")(
            str(buffer_id).encode(), timeout=timeout,
            metadata=((MAC_KEY, mac),))
        try:
            header = cast(_PeerHeader, m.decode(await call.read()))
            if "error" in header:
                raise header["error"]
            if "objects" in header:
                return header["objects"]
            target = np.empty(header["nbytes"], np.uint8)
            offset = 0
            while offset < header["nbytes"]:
                piece = await call.read()
                if piece is grpc.aio.EOF:
                    raise errors.WorkerLost(f"the worker at {peer} stopped sending buffer "
                                            f"{buffer_id} halfway.")
                target[offset:offset + len(piece)] = np.frombuffer(piece, np.uint8)
                offset += len(piece)
        except grpc.RpcError as e:
            raise errors.WorkerLost(
                f"fetching buffer {buffer_id} from the worker at {peer} failed: "
                f"{e.code().name}") from None
        return target.view(m.dtype_of(header["dtype"])).reshape(header["shape"])

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class Pulse:
    """Proves the worker alive from a thread of its own, over a channel of its own.

    Liveness must not depend on the worker's event loop, which may sit for seconds inside
    jaxlib (dispatch blocks while too many computations are in flight), nor on its stream,
    which may be full of bulk data. Every `interval` the thread calls `isthmus.Fleet/Alive`
    with the current membership token; the controller answers `ALIVE_OK`, `ALIVE_DROPPED`
    (it declared this worker lost: the worker must not act on its old state) or `ALIVE_STOP`.
    A stopped process (SIGSTOP) sends nothing, so it is declared lost like a dead one.
    """

    def __init__(self, address: str, interval: float,
                 on_answer: Callable[[bytes], None]) -> None:
        self.address = address.removeprefix("grpc://")
        self.interval = interval
        self.token: str | None = None  # None between memberships: nothing to prove
        self._on_answer = on_answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isthmus-pulse", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        alive = channel.unary_unary("/isthmus.Fleet/Alive")
        try:
            while not self._stop.wait(self.interval):
                token = self.token
                if token is None:
                    continue
                try:
                    answer = alive(token.encode(), timeout=max(2.0, 2 * self.interval))
                except grpc.RpcError as e:
                    logger.debug("pulse not answered: %s", e.code().name)
                    continue
                if token == self.token and not self._stop.is_set():
                    self._on_answer(answer)
        finally:
            channel.close()
