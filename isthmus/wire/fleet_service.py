"""Where workers connect: one control stream per worker, and two gRPC calls.

A worker asks `isthmus.Fleet/Endpoint` (on the controller's gRPC port, the address it was
given) for the port of the control streams, then opens a TCP stream there
(`transport/frames.py`), proves that it knows the fleet's token (`transport/auth.py`), and
sends `Register` first; the controller answers `Welcome` (or
`Refused`) and from then on sends command batches while the worker sends heartbeats,
replies and data. A stream that ends, for whatever reason, is the loss of that worker.
`Alive` is the worker's pulse, sent from a thread of its own so that a busy worker still
proves itself alive.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import grpc
import grpc.aio

from isthmus import errors
from isthmus.controller.manager import FleetManager
from isthmus.transport import auth
from isthmus.transport import messages as m
from isthmus.transport.frames import (
    FrameStream,
    Parts,
    StreamClosed,
    keep_alive,
    read_frame,
    serve,
    serve_unix,
    write_frame,
)
from isthmus.transport.tls import TlsConfig
from isthmus.wire.methods import Method
from isthmus.wire.servicer import CannotListen

logger = logging.getLogger(__name__)

SERVICE = "isthmus.Fleet"
REGISTER_TIMEOUT = 30.0  # seconds a new stream may take to send its Register
# What OpenSSL says when the first bytes of a stream are not a TLS ClientHello.
NOT_TLS = ("WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "HTTP_REQUEST", "RECORD_LAYER_FAILURE")


class FleetServicer:
    def __init__(self, manager: FleetManager, token: str = "",
                 tls: TlsConfig | None = None, joins: auth.JoinTokens | None = None) -> None:
        self.manager = manager
        self._token = token  # the fleet's: a stream must prove it first (`transport/auth.py`)
        self.joins = joins  # single-use tokens of the workers it launched, or None
        self._refused_peers: set[tuple[str, str]] = set()  # (host, why) logged once each
        self._tls = tls  # mutual TLS on every control stream (`transport/tls.py`), or None
        self.port = 0  # of the control streams, once started
        self.unix_path: str | None = None  # ... or their Unix socket (a fleet without TCP)
        self._server: asyncio.Server | None = None
        self._writers: set[FrameStream] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listens for control streams on `host`, `port` (0: a free one); returns the port."""
        try:
            self._server = await serve(self._connected, host, port)
        except OSError as e:
            raise CannotListen(f"cannot listen on {host}:{port} for the workers' control "
                               f"streams ({e.strerror}); pick another --fleet-port (0: a "
                               "free one)") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def start_unix(self, path: str) -> None:
        """Listens for control streams on a Unix socket at `path` (mode 0600): a fleet on
        one machine where no TCP socket may be opened."""
        try:
            self._server = await serve_unix(self._connected, path)
        except OSError as e:
            raise CannotListen(f"cannot listen on the Unix socket {path} for the workers' "
                               f"control streams ({e.strerror})") from None
        self.unix_path = path

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()

    def _connected(self, stream: FrameStream) -> None:
        # Runs inside the connection's `connection_made`, before any byte is read: with TLS,
        # reading waits for `start_tls`, or the plain stream would swallow the ClientHello
        # (the handshake then stalled until its timeout, 1 worker in 6 on loopback).
        if self._tls is not None and stream.transport is not None:
            stream.transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self._handle(stream, stream))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _handle(self, reader: FrameStream, writer: FrameStream) -> None:
        keep_alive(writer)
        self._writers.add(writer)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # The loop is shutting down. Ending quietly matters: asyncio's stream server
            # asks a cancelled handler for its exception in a done callback, which prints a
            # CancelledError traceback at exit (seen on Python 3.11 and 3.12).
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _serve(self, reader: FrameStream, writer: FrameStream) -> None:
        host, port = _peer(writer)
        if self._tls is not None:
            # The handshake is ours (not the server's), so that a refusal is one log line.
            try:
                await asyncio.wait_for(writer.start_tls(self._tls.server_context()),
                                       auth.HANDSHAKE_TIMEOUT)
            except (TimeoutError, ssl.SSLError, ConnectionError, OSError) as e:
                if isinstance(e, asyncio.TimeoutError) or getattr(
                        e, "reason", None) in NOT_TLS:
                    reason = ("it did not start TLS: a worker without --tls-cert, --tls-key "
                              "and --tls-ca?")
                elif isinstance(e, ssl.SSLError):
                    reason = f"{e.reason or e}: a certificate of another fleet CA?"
                else:
                    reason = "the worker gave up: it does not trust this controller's certificate"
                self._refused(host, port, f"TLS handshake failed ({reason})")
                return
        try:
            await auth.check_worker(reader, writer, self._token, self.joins)
        except auth.Unauthenticated as e:
            self._refused(host, port, str(e))
            return
        try:
            first = m.decode(await asyncio.wait_for(read_frame(reader), REGISTER_TIMEOUT))
        except Exception:  # noqa: BLE001 - silence, a broken stream, or not our encoding
            first = None
        if not isinstance(first, m.Register):
            write_frame(writer, m.encode(m.Refused("a worker stream must start with Register")))
            return
        # What the channel sends while it is being registered goes after the Welcome.
        early: list[bytes | Parts] | None = []

        def send(frame: bytes | Parts) -> None:
            if early is not None:
                early.append(frame)
            else:
                write_frame(writer, frame)

        try:
            channel = self.manager.register(first, send, f"ipv4:{host}:{port}",
                                            close=writer.close)
        except errors.IsthmusError as e:
            write_frame(writer, m.encode(m.Refused(e.message)))
            return
        write_frame(writer, m.encode(self.manager.welcome(channel)))
        assert early is not None  # set to None only below
        for frame in early:
            write_frame(writer, frame)
        early = None
        try:
            while True:
                channel.on_message(m.decode(await read_frame(reader)))
        except StreamClosed as e:
            logger.info("worker %s stream ended: %s", channel.slot, e)
        except Exception:
            logger.exception("worker %s sent a frame that does not decode", channel.slot)
        finally:
            self.manager.lost(channel, channel.leaving or
                              "its connection to the controller closed")

    def _refused(self, host: str, port: int, why: str) -> None:
        """Logs a refused worker stream: a warning the first time for its host and reason (a
        stranger that retries does not fill the log), at debug level after that."""
        seen = (host, why)
        level = logging.DEBUG if seen in self._refused_peers else logging.WARNING
        if len(self._refused_peers) > 4096:  # bounded, whoever knocks
            self._refused_peers.clear()
        self._refused_peers.add(seen)
        logger.log(level, "refused a worker stream from %s:%s: %s (the fleet did not change; "
                   "the same refusal of this host again is logged at debug level)", host, port,
                   why)

    async def endpoint(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The port of the control streams (on the host the worker reached us at), or
        their Unix socket as unix:PATH."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}".encode()
        return str(self.port).encode()

    async def alive(self, token: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A worker's pulse (from its own thread, apart from its stream). One the manager
        knows proves the connection a fleet worker's: on a shared service it is then no
        stranger (`wire/peers.py`)."""
        answer = self.manager.alive(token.decode(errors="replace"))
        prove = getattr(context, "prove", None)
        if answer == m.ALIVE_OK and prove is not None:
            prove()
        return answer

    def methods(self) -> dict[str, Method]:
        """The fleet's methods on the client port (raw bytes in and out)."""
        return {f"/{SERVICE}/Endpoint": Method("unary_unary", self.endpoint),
                f"/{SERVICE}/Alive": Method("unary_unary", self.alive)}


def _peer(writer: FrameStream) -> tuple[str, int]:
    address = writer.get_extra_info("peername")
    if not isinstance(address, tuple) or len(address) < 2:  # a Unix socket's: a path, or ""
        return "local", 0
    return address[0], address[1]
