import pytest

from isthmus.protocol.schema import schema
from isthmus.protocol.wireformat import (
    bytes_field,
    bytes_field_parts,
    bytes_message,
    read_varint,
    varint,
)


def test_framing_matches_protobuf():
    chunk = schema()["xla.ifrt.proxy.GrpcHostBufferStoreRequest"]
    for size in (0, 1, 127, 128, 300, 1 << 20):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        framed = b"".join(bytes_message(memoryview(data)))
        assert chunk.FromString(framed).data == data
        assert bytes(bytes_field(chunk(data=data).SerializeToString())) == data
    assert read_varint(varint(1 << 40), 0) == (1 << 40, 6)


def test_a_chunk_in_pieces_is_read_without_joining():
    chunk = schema()["xla.ifrt.proxy.GrpcHostBufferStoreRequest"]
    data = bytes(range(256)) * 3
    framed = chunk(data=data).SerializeToString()
    for cut in range(len(framed) + 1):  # in the header, in the data, at either end
        for second in (cut, min(cut + 1, len(framed)), len(framed)):
            pieces = (framed[:cut], framed[cut:second], framed[second:])
            assert b"".join(bytes(p) for p in bytes_field_parts(pieces)) == data, (cut, second)
    assert bytes_field_parts(b"") == []
    with pytest.raises(ValueError):
        bytes_field_parts((framed[:100], b"junk"))


def test_malformed_chunks_are_refused():
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x0f\x01",
                b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"):
        with pytest.raises(ValueError):
            bytes_field(bad)
