"""The protobuf wire format, for the few places that read or write it by hand: finding the
descriptors inside jaxlib, and framing bulk host-buffer chunks without a copy."""

from __future__ import annotations

from typing import Any


def read_varint(buf: Any, pos: int, end: int | None = None) -> tuple[int, int]:
    """(value, position after it); ValueError when the varint is cut short."""
    end = len(buf) if end is None else end
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def bytes_message(data: memoryview) -> tuple[bytes, memoryview]:
    """A serialized message whose only field is `bytes data = 1`, as its field header and
    the data itself (joined, the two are the message)."""
    return b"\x0a" + varint(len(data)), data


def bytes_field(message: bytes) -> memoryview:
    """Field 1 (`bytes data = 1`) of a serialized message, without copying.

    ValueError when the message is malformed."""
    view = memoryview(message)
    result = view[0:0]
    pos = 0
    while pos < len(view):
        tag, pos = read_varint(view, pos)
        wire_type = tag & 7
        if wire_type == 2:
            length, pos = read_varint(view, pos)
            if pos + length > len(view):
                raise ValueError("truncated field")
            if tag >> 3 == 1:
                result = view[pos:pos + length]
            pos += length
        elif wire_type == 0:
            _, pos = read_varint(view, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"wire type {wire_type}")
    if pos != len(view):
        raise ValueError("truncated message")
    return result


def bytes_field_parts(message: Any) -> list[memoryview]:
    """Field 1 of a serialized message whose only field it is (a host-buffer chunk), as views
    of its bytes; `message` is bytes-like or a sequence of consecutive buffers (a message
    received in pieces), which are not joined.

    ValueError when the message is malformed."""
    if not isinstance(message, (list, tuple)):
        data = bytes_field(message)
        return [data] if len(data) else []
    parts = [memoryview(p) for p in message]
    head = b"".join(bytes(p[:11]) for p in parts[:11])[:11]  # the tag and length varint
    total = sum(len(p) for p in parts)
    if not head or head[0] != 0x0A:
        return bytes_field_parts(b"".join(parts))  # another layout: parsed whole
    length, start = read_varint(head, 1)
    if start + length != total:
        return bytes_field_parts(b"".join(parts))
    out = []
    for part in parts:
        if start >= len(part):
            start -= len(part)
            continue
        out.append(part[start:])
        start = 0
    return out
