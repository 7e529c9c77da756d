"""h2's internals, as the client port (isthmus/wire/h2*.py) uses them: the only place in
isthmus that names them.

h2 (python-hyper's HTTP/2 state machine, with its hyperframe and hpack) is driven below
its public API where that saves a copy or a walk per frame (docs/design.md, "Bulk bytes on
the client port"): `Connection` is h2's connection with those seams as methods of its own.
Each internal it relies on is in `INTERNALS` with a check of its shape; `check()` runs them
all at import and raises `H2Changed` naming the installed h2 and the internal, so that an
upgrade fails at start, not in the middle of a transfer. One of h2's methods is replaced
outright (`_prepare_for_sending`, with our own loop); `tests/unit/test_http2_compat.py`
compares h2's body of it with that of the releases this module was written against
(`KNOWN`, fingerprints without annotations, docstrings or comments), so that a change there
fails in our tests, not at a user's start.

h2 formats every frame it receives for its trace log, logging on or off (a DATA frame's
repr hex-encodes its whole body). Instead of patching hyperframe's `Frame.__repr__` for
every user of hyperframe in the process, `Connection` hands h2 each received frame as an
instance of a `Quiet` subclass of its class (same slots, a short repr), which h2's dispatch
table maps to the same handler.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import h2
import h2.config
import h2.connection
import h2.errors
import h2.exceptions
import h2.frame_buffer
import h2.stream
import hpack
import hpack.exceptions
import hpack.huffman_table
import hyperframe.frame

VERSION = h2.__version__

# The h2 methods replaced here, by the fingerprints of their bodies in h2 4.1.0 to 4.4.1.
KNOWN = {
    "H2Connection._prepare_for_sending": {"7186ef41da796ddb"},
}

decode_huffman = hpack.huffman_table.decode_huffman  # hpackfast reads Huffman strings
MAX_WINDOW = (1 << 31) - 1  # the largest flow-control window HTTP/2 allows


class H2Changed(ImportError):
    """The installed h2 lacks an internal isthmus relies on, or has changed its shape."""


def _changed(internal: str, how: str = "no longer has") -> H2Changed:
    return H2Changed(
        f"isthmus needs h2's {internal}, which h2 {VERSION} {how}; pin h2<{VERSION} (or "
        "the release before it) or update isthmus/compat/h2.py.")


def fingerprint(fn: Callable[..., Any]) -> str:
    """A function's body without its annotations, docstring and comments."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(node, ast.FunctionDef)
    return fingerprint_of(node)


def fingerprint_of(node: ast.FunctionDef) -> str:
    """`fingerprint` of a function's syntax tree."""
    node.returns = None
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
            getattr(node.body[0], "value", None), ast.Constant):
        node.body = node.body[1:]
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            sub.annotation = None
    body = [s for s in node.body if not (isinstance(s, ast.AnnAssign) and s.value is None)]
    node.body = body
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]


def _sample() -> h2.connection.H2Connection:
    return h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))


def _method(name: str, *params: str) -> Callable[[], str | None]:
    def check() -> str | None:
        fn = getattr(h2.connection.H2Connection, name, None)
        if not callable(fn):
            return "no longer has"
        try:
            have = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        return None if have == ("self", *params) else f"now takes {have}"
    return check


def replaced_changed(name: str) -> str | None:
    """How h2's own `name` (a method `Connection` replaces) differs from the bodies in
    `KNOWN`, or None: for the tests, not for the import (a new h2 release may change a body
    harmlessly; its tests say so before it is allowed in pyproject.toml)."""
    try:
        found = fingerprint(getattr(h2.connection.H2Connection, name))
    except (OSError, TypeError):
        return None  # no source to compare (a frozen install): the shape checks stand
    if found not in KNOWN[f"H2Connection.{name}"]:
        return (f"has changed (fingerprint {found}; isthmus/compat/h2.py replaces it: "
                "compare the two, then add the fingerprint to KNOWN)")
    return None


def _attribute(name: str, kind: type) -> Callable[[], str | None]:
    def check() -> str | None:
        value = getattr(_sample(), name, None)
        if value is None:
            return "no longer has"
        return None if isinstance(value, kind) else f"made a {type(value).__name__}"
    return check


def _headers_buffer() -> str | None:
    buffer = getattr(_sample().incoming_buffer, "_headers_buffer", None)
    return None if isinstance(buffer, list) else "no longer has"


def _dispatch_table() -> str | None:
    table = getattr(_sample(), "_frame_dispatch_table", None)
    if not isinstance(table, dict):
        return "no longer has"
    return None if hyperframe.frame.DataFrame in table else "keys differently"


def _open_inbound_streams() -> str | None:
    prop = inspect.getattr_static(h2.connection.H2Connection, "open_inbound_streams", None)
    return None if isinstance(prop, property) else "no longer has as a property"


def _connection_state() -> str | None:
    sample = _sample()
    machine = getattr(sample, "state_machine", None)
    if not hasattr(h2.connection.ConnectionState, "SERVER_OPEN") or machine is None:
        return "no longer has"
    for name in ("highest_inbound_stream_id", "outbound_flow_control_window"):
        if not isinstance(getattr(sample, name, None), int):
            return f"no longer has ({name})"
    return None


def _closed_by_end() -> str | None:
    return None if hasattr(h2.stream.StreamClosedBy, "SEND_END_STREAM") else "no longer has"


def _raw_decode() -> str | None:
    # h2 decodes a header block with `decoder.decode(block, raw=True)`; hpackfast's decoder
    # reads such blocks itself.
    source = inspect.getsource(h2.connection._decode_headers)
    return None if "raw=True" in source else "no longer calls with raw=True"


def _hpack_table() -> str | None:
    decoder = hpack.Decoder()
    for name in ("header_table_size", "max_allowed_table_size", "max_header_list_size"):
        if not isinstance(getattr(decoder, name, None), int):
            return f"no longer has ({name})"
    table = getattr(decoder, "header_table", None)
    if not callable(getattr(table, "get_by_index", None)):
        return "no longer has (header_table.get_by_index)"
    return None if table.get_by_index(2) == (b":method", b"GET") else "indexes differently"


def _huffman() -> str | None:
    # "www.example.com" in Huffman's code (RFC 7541, C.4.1).
    sample = bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")
    return None if decode_huffman(sample) == b"www.example.com" else "decodes differently"


# Internal -> a check returning None, or how it changed ("no longer has", ...).
INTERNALS: dict[str, Callable[[], str | None]] = {
    "H2Connection._receive_frame": _method("_receive_frame", "frame"),
    "H2Connection._prepare_for_sending": _method("_prepare_for_sending", "frames"),
    "H2Connection._terminate_connection": _method("_terminate_connection", "error_code"),
    "H2Connection._open_streams": _method("_open_streams", "remainder"),
    "H2Connection.open_inbound_streams": _open_inbound_streams,
    "H2Connection._data_to_send": _attribute("_data_to_send", bytearray),
    "H2Connection._closed_streams": _attribute("_closed_streams", dict),
    "H2Connection._frame_dispatch_table": _dispatch_table,
    "H2Connection.streams": _attribute("streams", dict),
    "H2Connection.state_machine, highest_inbound_stream_id, outbound_flow_control_window":
        _connection_state,
    "FrameBuffer._headers_buffer": _headers_buffer,
    "StreamClosedBy.SEND_END_STREAM": _closed_by_end,
    "_decode_headers (decoder.decode(block, raw=True))": _raw_decode,
    "hpack.Decoder.header_table": _hpack_table,
    "hpack.huffman_table.decode_huffman": _huffman,
}


def check_one(internal: str) -> None:
    """Raises `H2Changed` when `internal` (a key of `INTERNALS`) is not as isthmus uses it."""
    how = INTERNALS[internal]()
    if how is not None:
        raise _changed(internal, how)


def check() -> None:
    for internal in INTERNALS:
        check_one(internal)


check()


def _quiet_repr(self: hyperframe.frame.Frame) -> str:
    return (f"{type(self).__mro__[1].__name__}(stream_id={self.stream_id}, "
            f"{len(getattr(self, 'data', b''))} bytes of data)")


def _quiet(frame_class: type[hyperframe.frame.Frame]) -> type[hyperframe.frame.Frame]:
    """`frame_class` with a repr of its kind, stream and size (no slots of its own, so a
    parsed frame can take it as its class)."""
    return type(frame_class.__name__, (frame_class,),
                {"__slots__": (), "__repr__": _quiet_repr, "__module__": __name__})


# hyperframe's frame class -> isthmus's quiet one, for every kind of frame h2 dispatches.
_QUIET: dict[type, type] = {cls: _quiet(cls) for cls in hyperframe.frame.FRAMES.values()}
QuietData = _QUIET[hyperframe.frame.DataFrame]


class Held:
    """Bytes handed to h2 to send without its copying them (h2 takes only their length)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


class Connection(h2.connection.H2Connection):
    """h2's connection, whose internals isthmus uses through the methods below: sent frames
    are kept as a list of buffers (`take`), in order with frames serialized elsewhere
    (`raw`) and DATA frames of `Held` bytes (`held`, which a subclass writes); received DATA
    frames parsed elsewhere go in whole (`receive_data_frame`); streams answered elsewhere
    are forgotten (`forget_stream`); and no received frame is formatted for h2's trace log."""

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        table = self._frame_dispatch_table
        for frame_class, quiet in _QUIET.items():
            if frame_class in table:
                table[quiet] = table[frame_class]
        self.out: list[bytes | memoryview] = []  # what to write before _data_to_send
        self._sweep_at = 64

    def held(self, stream_id: int, view: memoryview, end_stream: bool) -> None:
        """Writes a DATA frame of `Held` bytes (h2 has counted them)."""
        raise NotImplementedError

    # Sending.
    def _prepare_for_sending(self, frames: list[hyperframe.frame.Frame]) -> None:
        for frame in frames:
            data = getattr(frame, "data", None)
            if type(data) is Held:
                self.held(frame.stream_id, data.view, "END_STREAM" in frame.flags)
            else:
                self._data_to_send += frame.serialize()

    def raw(self, frame: bytes | memoryview) -> None:
        """A frame (or bytes) serialized elsewhere, sent in order with h2's."""
        if self._data_to_send:
            self.out.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        self.out.append(frame)

    def take(self) -> list[bytes | memoryview]:
        """Everything to write now, in order."""
        out, self.out = self.out, []
        if self._data_to_send:
            out.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        return out

    # Receiving.
    def _receive_frame(self, frame: hyperframe.frame.Frame) -> list[Any]:
        quiet = _QUIET.get(frame.__class__)
        if quiet is not None:
            frame.__class__ = quiet
        return super()._receive_frame(frame)

    def receive_data_frame(self, stream_id: int, end_stream: int, body: Any) -> list[Any]:
        """A whole DATA frame without padding, as `receive_data` would take its bytes."""
        if self.incoming_buffer._headers_buffer:  # a DATA frame inside a header block
            self._terminate_connection(h2.errors.ErrorCodes.PROTOCOL_ERROR)
            raise h2.exceptions.ProtocolError("Invalid frame during header block.")
        frame = QuietData(stream_id)
        frame.data = body
        if end_stream:
            frame.flags.add("END_STREAM")
        try:
            return self._receive_frame(frame)
        except h2.exceptions.ProtocolError as e:
            self._terminate_connection(e.error_code)
            raise

    # Streams.
    @property
    def open_inbound_streams(self) -> int:
        """An upper bound of the client's open streams, checked against our (generous)
        concurrency limit for each new one. h2 counts them by walking every stream, which
        also drops the closed ones: with thousands of uploads open that walk was a third
        of the server's time, so it runs here once the table has doubled since the last."""
        if len(self.streams) >= self._sweep_at:
            self._open_streams(1)
            self._sweep_at = max(64, 2 * len(self.streams))
        return len(self.streams)

    def claim_stream(self, stream_id: int) -> bool:
        """Whether a new client stream with this id may be opened without h2 (its HEADERS
        frame taken elsewhere): the connection is open, no header block is half received,
        and the id is odd and above every stream so far (h2 has opened one: the
        connection's state is SERVER_OPEN). If so, h2 counts the id as used
        (it then treats the stream's frames as those of a closed one), else nothing
        changes and h2 should see the frame."""
        if (not stream_id & 1 or stream_id <= self.highest_inbound_stream_id
                or self.state_machine.state is not h2.connection.ConnectionState.SERVER_OPEN
                or self.incoming_buffer._headers_buffer):
            return False
        self.highest_inbound_stream_id = stream_id
        return True

    def take_window_update(self, stream_id: int, increment: int) -> bool:
        """A WINDOW_UPDATE frame taken without h2 where h2 would only count it: the
        connection's (its window grows) or a closed stream's (h2 ignores those; a bare
        stream's, once answered, is one). False, and nothing done, for any other (a frame
        h2 must see, or judge as an error)."""
        if (not 0 < increment <= MAX_WINDOW
                or self.state_machine.state is not h2.connection.ConnectionState.SERVER_OPEN):
            return False
        if stream_id:
            return bool(stream_id & 1) and stream_id <= self.highest_inbound_stream_id \
                and stream_id not in self.streams
        window = self.outbound_flow_control_window + increment
        if window > MAX_WINDOW:
            return False  # h2 reports the flow-control error
        self.outbound_flow_control_window = window
        return True

    def forget_stream(self, stream_id: int) -> None:
        """h2 forgets a stream answered (and ended) without it, as if it had closed it."""
        if self.streams.pop(stream_id, None) is not None:
            self._closed_streams[stream_id] = h2.stream.StreamClosedBy.SEND_END_STREAM
