"""The fleet's codec: every record and value the fleet carries round-trips (tuples stay
tuples, errors keep their class and status code, arrays their dtype), and a frame can only
build registered records: an unknown record name, an unknown extension or a value of
another type is a CodecError, never code run."""

import ml_dtypes
import msgpack
import numpy as np
import pytest

from isthmus import dtypes, errors
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport import records
from isthmus.transport.codec import CodecError


def roundtrip(value):
    return m.decode(m.encode(value))


def test_records_and_values_round_trip():
    f32 = dtypes.BY_KIND["KIND_F32"]
    info = records.CompiledInfo(
        "step", (records.Aval(f32, (2, 3)),), (records.Aval(f32, ()),), (b"\x08\x01",),
        None, ("{1,0}",), ("{}",), ("device",), (0,), b"fp", {"flops": 12.0, "n": 3}, "hlo",
        {"temp_size_in_bytes": 4}, 10)
    values = [
        m.Batch((c.Execute(3, (7, (8, 9)), (10,), frozenset({1})), c.Free(range(4, 8)),
                 m.Shared(m.encode((c.Free((1, 2)),))))),
        c.Assemble(1, 0, "pinned_host", "float32", (2, 3),
                   ((5, (slice(0, 2), slice(None)), (slice(0, 2), slice(1, 3, 1))),)),
        m.DeviceMap({0: 5, 7: 12}),
        m.Heartbeat({"buffers": 3, "bytes": 1 << 40}, 9),
        m.Reply(4, info),
        m.Reply(5, ("float32", (4, 4))),
        m.Welcome(1, 0, 1, 0.5, ("/dev/shm/x", "probe"), "token"),
        m.PutData(1, 2, 0, b"\x00" * 1000, True),
        m.Ask(6, c.Compile(2, records.ColocatedProgram(
            "f", b"\x80\x05pickle", (0, 1), ((0, 1),), ((1, 0), (0,)),
            (("float32", (4,)), ("string", ()))))),
        m.Ask(9, c.Compile(3, records.CompileRequest(b"mlir", b"options", (0, 1), 1, "t"))),
        c.Load(3, records.CompileRequest(b"mlir", b"options", (0, 1))),
        m.Ask(7, c.CallPython(2, (10, (12, 11)), (20, 22), (3, -2992125004297323123))),
        m.Ask(8, c.StartProfile("t1", records.TraceOptions(2, 1, (("gpu_max_events", 9),)))),
        c.Assemble(1, 0, None, None, (2,), ((5, (slice(0, 2),), (slice(0, 2),)),)),
    ]
    for value in values:
        assert roundtrip(value) == value
    error = roundtrip(m.Reply(8, error=errors.UserCodeError("f raised ValueError"))).error
    assert type(error) is errors.UserCodeError and error.code == errors.Code.UNKNOWN
    assert error.message == "f raised ValueError"
    assert roundtrip(m.Reply(4, info)).value.params[0].dtype is f32


def test_arrays_errors_and_objects():
    for value in (np.arange(6, dtype=np.int64).reshape(2, 3),
                  np.ones((2,), ml_dtypes.bfloat16), np.zeros((0, 4), np.uint8),
                  np.array(True)):
        back = roundtrip(m.Reply(1, value)).value
        assert back.dtype == value.dtype and back.shape == value.shape
        np.testing.assert_array_equal(back, value)
        assert back.flags.writeable
    strings = np.array([["a", "bc"], ["", "d"]], dtype=object)
    back = roundtrip(m.PutObjects(1, 2, 0, strings)).value
    assert back.dtype == object and back.tolist() == strings.tolist()
    error = roundtrip(m.Reply(1, None, errors.WorkerLost("worker 3 is gone"))).error
    assert type(error) is errors.WorkerLost and error.message == "worker 3 is gone"
    assert error.code == errors.Code.DATA_LOSS
    custom = errors.InvalidRequest("bad", code=errors.Code.NOT_FOUND)
    assert roundtrip(c.Fail(1, custom)).error.code == errors.Code.NOT_FOUND
    assert roundtrip(m.Reply(1, [1, 2])).value == (1, 2)  # lists arrive as tuples
    assert roundtrip(m.Reply(1, np.int64(7))).value == 7


def test_a_frame_builds_nothing_that_is_not_registered():
    with pytest.raises(CodecError, match="does not carry values of type"):
        m.encode(m.Reply(1, object()))
    forged = msgpack.packb([msgpack.ExtType(1, b"os.system"), "echo owned"])
    with pytest.raises(CodecError, match="no record of the fleet"):
        m.decode(forged)
    with pytest.raises(CodecError, match="unknown extension"):
        m.decode(msgpack.packb([msgpack.ExtType(99, b"")]))
    with pytest.raises(CodecError, match="does not decode"):
        m.decode(b"\xc1garbage")


def test_a_record_decodes_whole_and_frozen_and_a_wrong_count_of_fields_is_refused():
    """A decoded record is equal, hashed alike and still frozen; a frame with a field missing
    (that has no default) or one too many is a CodecError, as the class refuses it."""
    import dataclasses

    command = roundtrip(c.Execute(3, (7, 8), (10,), frozenset({1})))
    assert command == c.Execute(3, (7, 8), (10,), frozenset({1}))
    assert hash(command) == hash(c.Execute(3, (7, 8), (10,), frozenset({1})))
    with pytest.raises(dataclasses.FrozenInstanceError):
        command.executable = 4
    execute = msgpack.ExtType(1, b"Execute")
    assert m.decode(msgpack.packb([execute, 3, [7], [10]])) == c.Execute(3, (7,), (10,))
    for fields in ([3, [7]], [3, [7], [10], [], "extra"]):
        with pytest.raises(CodecError, match="does not decode"):
            m.decode(msgpack.packb([execute, *fields]))


def test_bulk_bytes_travel_beside_the_message_over_a_real_stream():
    import asyncio

    from isthmus.transport.frames import connect, read_frame, serve, write_frame

    first = np.arange(3 << 18, dtype=np.float32)  # 3 MiB: read in place
    second = np.frombuffer(b"tail bytes", np.uint8)
    big = m.Batch((m.PutData(1, 7, 0, m.Bulk(first), False), c.Free((1,)),
                   m.PutData(1, 7, first.nbytes, m.Bulk(second), True)))
    small = m.Data(2, 0, m.Bulk(second))  # a tail small enough to come with the frame

    async def exchange():
        got = asyncio.get_running_loop().create_future()

        def connected(stream):
            async def read():
                hello = await stream.readexactly(5)  # raw bytes before the first frame
                got.set_result([hello] + [m.decode(await read_frame(stream))
                                          for _ in range(3)])
            asyncio.ensure_future(read())

        server = await serve(connected, "127.0.0.1", 0)
        stream = await connect("127.0.0.1", server.sockets[0].getsockname()[1])
        stream.write(b"hello")
        for message in (big, small, c.Free((2,))):  # a plain frame last
            write_frame(stream, m.encode(message))
        result = await asyncio.wait_for(got, 10)
        stream.close()
        server.close()
        return result

    hello, decoded, data, plain = asyncio.run(exchange())
    assert hello == b"hello" and plain == c.Free((2,))
    a, free, b = decoded.commands
    assert (a.request, a.buffer, a.offset, a.last, free) == (1, 7, 0, False, c.Free((1,)))
    received = np.frombuffer(a.data, np.float32)
    assert np.array_equal(received, first)
    assert received.ctypes.data % 64 == 0  # jaxlib may adopt it without a copy
    assert bytes(b.data) == b"tail bytes" and b.offset == first.nbytes and b.last
    assert bytes(data.data) == b"tail bytes" and data.request == 2
    # Encoded whole (inside another message), bulk bytes are copied in.
    assert m.decode(m.CODEC.encode(m.Data(3, 0, m.Bulk(second)))) == m.Data(3, 0, b"tail bytes")


def test_a_put_in_pieces_or_whole_and_a_fetch_in_pieces():
    from isthmus.hostmem import Assembly
    from isthmus.transport.remote import _Incoming as Fetched
    from isthmus.worker.reading import Incoming

    value = np.arange(1000, dtype=np.int32).reshape(10, 100)
    raw = memoryview(value.tobytes())
    whole = Incoming(Assembly(value.nbytes), 0, None, np.dtype(np.int32), (10, 100))
    assert np.array_equal(whole.add(0, raw), value)
    pieces = Incoming(Assembly(value.nbytes), 0, None, np.dtype(np.int32), (10, 100))
    pieces.add(0, raw[:1000])
    assert np.array_equal(pieces.add(1000, raw[1000:]), value)
    for cuts in ((0, len(raw)), (0, 4, 1000, len(raw))):
        fetched = Fetched(m.FetchHeader(1, "int32", (10, 100), value.nbytes))
        for start, end in zip(cuts, cuts[1:]):
            fetched.write(start, raw[start:end])
        assert np.array_equal(fetched.array(), value)
