"""The bytes under the h2 transport (wire/h2frames.py): frames cut at every place by the
socket's reads still reach h2 whole and in order, large DATA bodies included, and large
sent frames are the bytes h2 would have written."""

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import hyperframe.frame
import pytest

from isthmus.compat.h2 import Held
from isthmus.wire.h2frames import Frames, Wire

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
BIG = (1 << 24) - 1


class _Transport:
    def __init__(self):
        self.written = []

    def set_write_buffer_limits(self, high):
        pass

    def write(self, data):
        self.written.append(bytes(data))

    def is_closing(self):
        return False

    def close(self):
        pass

    def get_write_buffer_size(self):
        return 0


def _server() -> Frames:
    frames = Frames(h2.config.H2Configuration(client_side=False, header_encoding=None))
    frames.local_settings = h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_FRAME_SIZE: BIG,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24})
    frames.max_inbound_frame_size = BIG
    frames.initiate_connection()
    frames.increment_flow_control_window(1 << 30)
    return frames


def _client_bytes(bodies: list[bytes]) -> bytes:
    headers = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"),
                                      (":path", "/t.T/Upload"), (":authority", "x"),
                                      ("content-type", "application/grpc")])
    out = [PREFACE, hyperframe.frame.SettingsFrame(0).serialize(),
           hyperframe.frame.HeadersFrame(1, data=headers, flags=["END_HEADERS"]).serialize()]
    for i, body in enumerate(bodies):
        flags = ["END_STREAM"] if i == len(bodies) - 1 else []
        out.append(hyperframe.frame.DataFrame(1, data=body, flags=flags).serialize())
    out.append(hyperframe.frame.PingFrame(0, opaque_data=b"12345678").serialize())
    return b"".join(out)


@pytest.mark.parametrize("read", [1, 5, 9, 10, 1000, 65536 + 3, 1 << 20])
def test_frames_cut_anywhere_arrive_whole(read):
    bodies = [bytes(range(256)) * 1024, b"small", bytes(70_000), b"x" * 65_536, b"end"]
    stream = _client_bytes(bodies)

    async def body():
        frames, events = _server(), []
        wire = Wire(lambda: frames, lambda transport: None, events.extend, 1 << 20)
        wire.connection_made(_Transport())
        at = 0
        while at < len(stream):
            buffer = wire.get_buffer(-1)
            n = min(len(buffer), read, len(stream) - at)
            buffer[:n] = stream[at:at + n]
            at += n
            wire.buffer_updated(n)
        return events

    events = asyncio.run(body())
    data = [bytes(e.data) for e in events if isinstance(e, h2.events.DataReceived)]
    assert data == bodies
    assert [type(e) for e in events if isinstance(e, (h2.events.StreamEnded,
                                                      h2.events.PingReceived))] == [
        h2.events.StreamEnded, h2.events.PingReceived]


def test_a_held_frame_is_the_bytes_h2_would_send():
    payload = bytes(range(256)) * 400
    mine = _server()
    mine.receive_data(_client_bytes([b""])[:-17])  # the client's preface and its call
    theirs = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    theirs.initiate_connection()
    theirs.receive_data(_client_bytes([b""])[:-17])
    for connection in (mine, theirs):
        connection.max_outbound_frame_size = BIG
        connection.outbound_flow_control_window = 1 << 20
        connection.streams[1].outbound_flow_control_window = 1 << 20
        connection.send_headers(1, [(b":status", b"200")])
    mine.take(), theirs.data_to_send()
    mine.send_data(1, Held(memoryview(payload)))
    theirs.send_data(1, payload)
    sent = mine.take()
    assert b"".join(bytes(p) for p in sent) == theirs.data_to_send()
    assert any(isinstance(p, memoryview) and p.obj is payload for p in sent)  # not copied
