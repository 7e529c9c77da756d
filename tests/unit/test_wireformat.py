import pytest

from isthmus.protocol.schema import schema
from isthmus.protocol.wireformat import bytes_field, bytes_message, read_varint, varint


def test_framing_matches_protobuf():
    chunk = schema()["xla.ifrt.proxy.GrpcHostBufferStoreRequest"]
    for size in (0, 1, 127, 128, 300, 1 << 20):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        framed = bytes_message(memoryview(data))
        assert chunk.FromString(framed).data == data
        assert bytes(bytes_field(chunk(data=data).SerializeToString())) == data
    assert read_varint(varint(1 << 40), 0) == (1 << 40, 6)


def test_malformed_chunks_are_refused():
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x0f\x01", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"):
        with pytest.raises(ValueError):
            bytes_field(bad)
