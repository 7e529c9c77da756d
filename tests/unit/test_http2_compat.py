"""isthmus/compat/h2.py: every h2 internal the client port relies on is there with the shape
it is used in, and a change fails naming the installed h2 and the internal. Each check runs
as a test of its own, so an h2 upgrade that breaks one says which."""

import h2
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import hyperframe.frame
import pytest

from isthmus.compat import h2 as compat
from isthmus.compat.h2 import Held
from isthmus.wire.h2frames import Frames

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.mark.parametrize("internal", list(compat.INTERNALS))
def test_each_internal_is_as_isthmus_uses_it(internal):
    how = compat.INTERNALS[internal]()
    assert how is None, (f"upgrading to h2 {h2.__version__} broke isthmus: its {internal} "
                         f"{how}; update isthmus/compat/h2.py")


def test_a_missing_internal_names_the_version_and_the_fix(monkeypatch):
    monkeypatch.delattr(h2.connection.H2Connection, "_open_streams")
    with pytest.raises(compat.H2Changed) as e:
        compat.check_one("H2Connection._open_streams")
    assert f"h2 {h2.__version__} no longer has" in str(e.value)
    assert "H2Connection._open_streams" in str(e.value) and "pin h2<" in str(e.value)


def test_the_replaced_methods_of_h2_are_those_isthmus_was_written_against():
    for name in ("_prepare_for_sending",):
        how = compat.replaced_changed(name)
        assert how is None, (f"upgrading to h2 {h2.__version__} broke isthmus: its "
                             f"H2Connection.{name} {how}")


def test_a_changed_replaced_method_is_caught(monkeypatch):
    def _prepare_for_sending(self, frames):
        return None
    monkeypatch.setattr(h2.connection.H2Connection, "_prepare_for_sending",
                        _prepare_for_sending)
    assert "has changed" in compat.replaced_changed("_prepare_for_sending")


def test_received_frames_are_not_formatted(monkeypatch):
    """h2 formats each received frame for its trace log; isthmus's quiet classes keep that
    from hex-encoding bodies (and hyperframe's own classes are left alone)."""
    def refuse(self):
        raise AssertionError(f"{type(self).__name__} was formatted in full")
    for cls in (hyperframe.frame.DataFrame, hyperframe.frame.HeadersFrame,
                hyperframe.frame.SettingsFrame, hyperframe.frame.WindowUpdateFrame):
        monkeypatch.setattr(cls, "_body_repr", refuse)
    frames = _server()
    _open(frames, 1)
    frames.receive_data(hyperframe.frame.DataFrame(1, data=b"x" * 100).serialize())
    frames.receive_data(hyperframe.frame.WindowUpdateFrame(0, window_increment=10).serialize())
    events = frames.receive_data_frame(1, True, b"abc")
    assert h2.events.StreamEnded in [type(e) for e in events]


def test_no_global_patch_of_hyperframe():
    assert hyperframe.frame.Frame.__repr__ is not object.__repr__
    assert "stream_id" in repr(hyperframe.frame.PingFrame(0))
    assert "flags" in repr(hyperframe.frame.PingFrame(0))  # hyperframe's own repr


def _server():
    frames = Frames(h2.config.H2Configuration(client_side=False, header_encoding=None))
    frames.initiate_connection()
    frames.receive_data(PREFACE + hyperframe.frame.SettingsFrame(0).serialize())
    return frames


def _open(frames, stream_id, end_stream=False):
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"),
                                    (":path", "/t.T/M"), (":authority", "x")])
    flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
    return frames.receive_data(hyperframe.frame.HeadersFrame(
        stream_id, data=block, flags=flags).serialize())


def test_the_seams_work_on_this_h2():
    """The behaviour each internal stands for, end to end on this h2."""
    frames = _server()
    frames.take()
    events = _open(frames, 1)  # the header block through hpackfast (raw=True)
    assert isinstance(events[0], h2.events.RequestReceived)
    # A DATA frame parsed elsewhere (_receive_frame, _frame_dispatch_table).
    events = frames.receive_data_frame(1, True, b"abc")
    assert [type(e) for e in events] == [h2.events.DataReceived, h2.events.StreamEnded]
    # Held bytes are written by `held`, in order with h2's own frames (_prepare_for_sending,
    # _data_to_send).
    frames.send_headers(1, [(b":status", b"200")])
    frames.send_data(1, Held(memoryview(b"x" * 10)), end_stream=True)
    out = b"".join(bytes(b) for b in frames.take())
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", "/t.T/M"),
                            (":authority", "x")], end_stream=True)
    kinds = [type(e) for e in client.receive_data(out)]
    assert h2.events.DataReceived in kinds and h2.events.StreamEnded in kinds
    # A stream answered elsewhere is forgotten as closed (_closed_streams).
    _open(frames, 3)
    frames.forget_stream(3)
    assert 3 not in frames.streams
    # A DATA frame inside a header block is a connection error (_headers_buffer).
    frames.receive_data(hyperframe.frame.HeadersFrame(5, data=b"\x83").serialize())
    with pytest.raises(h2.exceptions.ProtocolError):
        frames.receive_data_frame(5, False, b"x")
    assert b"\x07" in b"".join(bytes(b) for b in frames.take())  # GOAWAY (_terminate_...)


def test_data_on_a_reset_stream_is_answered_with_rst_stream():
    """h2's `_receive_frame` answers a frame of a quiet class on a stream the server reset
    as it does hyperframe's own: with RST_STREAM."""
    frames = _server()
    _open(frames, 1)
    frames.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    frames.take()
    assert frames.receive_data_frame(1, False, b"late") == []
    out = b"".join(bytes(b) for b in frames.take())
    assert out[3] == 0x3  # RST_STREAM


def test_open_inbound_streams_sweeps_closed_streams():
    frames = _server()
    for stream_id in range(1, 300, 2):
        _open(frames, stream_id, end_stream=True)
        frames.send_headers(stream_id, [(b":status", b"200")], end_stream=True)
    # h2 consults the property for each new stream; closed ones were dropped on the way.
    assert len(frames.streams) < 150
    assert frames.open_inbound_streams == len(frames.streams)
