"""HPACK decoding of the header blocks that leave the dynamic table alone, without hpack's
per-field objects.

The stock client opens a stream for every shard it uploads, and its header block is then
the same eight indexed fields and one literal (the store metadata, "without indexing"). hpack
decodes each field through a memoryview slice, a `HeaderTuple` and a re-made `HeaderTuple`:
about 40 µs a block, a sixth of the server's time on small sharded puts. `Decoder` reads
such a block (indexed fields and literals without or never indexed: representations that
neither add to nor resize the table) straight from its bytes, and gives any other block,
or anything it does not understand, to hpack, which then decodes the whole block itself
(nothing was changed before), with its own errors.
"""

from __future__ import annotations

from collections.abc import Iterable

import hpack
from hpack.exceptions import HPACKDecodingError, InvalidTableIndex

from isthmus.compat.h2 import decode_huffman

_ENTRY_OVERHEAD = 32  # RFC 7541, 4.1: the size of an entry is its name, value and 32


class _Unusual(Exception):
    """A representation the fast path leaves to hpack."""


class Decoder(hpack.Decoder):
    """hpack's decoder; `decode(block, raw=True)` (as h2 calls it) reads blocks that do not
    change the table itself."""

    # Plain (name, value) tuples where hpack makes HeaderTuples: h2 reads either alike.
    def decode(self, data: bytes, raw: bool = False  # type: ignore[override]
               ) -> Iterable[tuple[bytes, bytes]]:
        if raw:
            headers = self.read_only(bytes(data))
            if headers is not None:
                return headers
        # hpack decodes it from the start, and raises what it finds
        return super().decode(data, raw)

    def read_only(self, data: bytes) -> list[tuple[bytes, bytes]] | None:
        """A header block that leaves the table as it is, decoded; None for any other
        (nothing changed: h2 may decode it)."""
        try:
            return self._read_only(data)
        except (_Unusual, IndexError, InvalidTableIndex, HPACKDecodingError):
            return None

    def _read_only(self, data: bytes) -> list[tuple[bytes, bytes]]:
        if self.header_table_size > self.max_allowed_table_size:
            raise _Unusual  # hpack's own check of the table size reports it
        get = self.header_table.get_by_index
        headers: list[tuple[bytes, bytes]] = []
        size, at, end = 0, 0, len(data)
        limit = self.max_header_list_size
        while at < end:
            first = data[at]
            if first & 0x80:  # an indexed field
                index, at = _integer(data, at, 0x7F)
                if index == 0:
                    raise _Unusual
                name, value = get(index)
            elif first & 0xE0 == 0:  # a literal without indexing, or never indexed
                index, at = _integer(data, at, 0x0F)
                if index:
                    name = get(index)[0]
                else:
                    name, at = _string(data, at)
                value, at = _string(data, at)
            else:  # a literal to add to the table, or a size update
                raise _Unusual
            size += len(name) + len(value) + _ENTRY_OVERHEAD
            if size > limit:
                raise _Unusual  # hpack raises OversizedHeaderListError
            headers.append((name, value))
        return headers


def _integer(data: bytes, at: int, mask: int) -> tuple[int, int]:
    """An HPACK integer with a prefix of `mask` bits at `at`; the value and where it ends."""
    value = data[at] & mask
    at += 1
    if value < mask:
        return value, at
    shift = 0
    while True:
        byte = data[at]
        at += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at
        if shift > 63:
            raise _Unusual


def _string(data: bytes, at: int) -> tuple[bytes, int]:
    huffman = data[at] & 0x80
    length, at = _integer(data, at, 0x7F)
    if at + length > len(data):
        raise _Unusual  # truncated: hpack says so
    raw = data[at:at + length]
    return (decode_huffman(raw) if huffman else raw), at + length
