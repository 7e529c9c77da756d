"""The fast HPACK decoder against hpack's own, block for block."""

import random

import hpack
import pytest

from isthmus.wire.hpackfast import Decoder

NAMES = [b":path", b":authority", b"content-type", b"te", b"user-agent", b"x-custom",
         b"ifrt-proxy-grpc-host-buffer-store-metadata-bin", b"grpc-timeout", b"a" * 200]


def _headers(rng):
    out = []
    for _ in range(rng.randint(0, 12)):
        name = rng.choice(NAMES)
        value = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 5, 30, 300])))
        kind = rng.random()
        if kind < 0.3:
            out.append(hpack.NeverIndexedHeaderTuple(name, value))
        else:
            out.append(hpack.HeaderTuple(name, value))
    return out


def test_every_block_decodes_as_hpack_decodes_it(monkeypatch):
    rng = random.Random(7)
    encoder, theirs, ours = hpack.Encoder(), hpack.Decoder(), Decoder()
    slow = []
    hpack_decode = hpack.Decoder.decode
    monkeypatch.setattr(hpack.Decoder, "decode", lambda self, data, raw=False: (
        slow.append(self) if self is ours else None, hpack_decode(self, data, raw))[1])
    repeated = _headers(rng)
    for i in range(3000):
        if i % 500 == 250:  # the table shrinks: a size update opens the next block
            encoder.header_table_size = rng.choice([0, 256, 4096])
        headers = repeated if rng.random() < 0.4 else _headers(rng)
        block = encoder.encode(headers, huffman=rng.random() < 0.5)
        want = [tuple(h) for h in theirs.decode(block, raw=True)]
        assert ours.decode(block, raw=True) == want
        assert list(ours.header_table.dynamic_entries) == list(theirs.header_table.dynamic_entries)
    assert 300 < len(slow) < 2700  # both paths taken, many times
    # Not raw: hpack's own path.
    block = encoder.encode([(b"k", b"v")])
    assert list(ours.decode(block)) == list(theirs.decode(block))


def test_what_the_fast_path_cannot_read_fails_as_in_hpack():
    encoder = hpack.Encoder()
    good = encoder.encode([(b":path", b"/x"), hpack.NeverIndexedHeaderTuple(b"k", b"v" * 40)])
    # Truncated, index 0, huge index, short, unknown, late update.
    bad = [good[:-3], b"\x80", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x00\x85ab",
           bytes([0xBE]), good + b"\x20"]
    for block in bad:
        with pytest.raises(Exception) as theirs:
            hpack.Decoder().decode(block, raw=True)
        with pytest.raises(Exception) as ours:
            Decoder().decode(block, raw=True)
        assert type(ours.value) is type(theirs.value), block
    small = Decoder()
    small.max_header_list_size = 50
    with pytest.raises(hpack.OversizedHeaderListError):
        small.decode(encoder.encode([(b"k", b"v" * 100)]), raw=True)
