"""Layouts as XLA writes them ("{0,1:T(8,128)}") and as the client's protos carry them.

A backend's default layouts are its own: row-major on CPU and GPU, tiled and often
transposed on a TPU. The hosts report layouts as XLA's text (`str` of a jaxlib layout);
executables' parameter and output layouts go to the client as `xla.LayoutProto`s with their
tiles, and an upload may name the device's default layout in either of its forms.
"""

from __future__ import annotations

from typing import Any

from isthmus import errors
from isthmus.frontend.message import Message
from isthmus.protocol.schema import Schema

COMBINE = -(1 << 63)  # XLA's Tile::kCombineDimension, written "*"


def fill(text: str, out: Message) -> None:
    """Fills an `xla.LayoutProto` from XLA's text of a layout: the minor-to-major order, the
    tiles (T(8,128)(2,1)), the element size in bits (E(4)) and the memory space (S(1));
    other attributes are left out."""
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    order, _, rest = body.partition(":")
    if order.strip():
        out.minor_to_major.extend(int(x) for x in order.split(","))
    i = 0
    while i < len(rest):
        letter = rest[i]
        if letter == "T":
            i += 1
            while i < len(rest) and rest[i] == "(":
                end = rest.index(")", i)
                tile = out.tiles.add()
                tile.dimensions.extend(COMBINE if d.strip() == "*" else int(d)
                                       for d in rest[i + 1:end].split(",") if d.strip())
                i = end + 1
        elif rest[i:i + 2] in ("E(", "S("):
            end = rest.index(")", i)
            value = int(rest[i + 2:end])
            if letter == "E":
                out.element_size_in_bits = value
            else:
                out.memory_space = value
            i = end + 1
        elif rest[i + 1:i + 2] == "(" or rest[i + 2:i + 3] == "(":  # another attribute
            i = rest.index(")", i) + 1
        else:
            i += 1


def same(proto: Message, text: str, schema_layout: Any) -> bool:
    """Whether an `xla.LayoutProto` is the layout XLA wrote as `text` (in what `fill` keeps)."""
    want = schema_layout()
    fill(text, want)
    return (list(proto.minor_to_major) == list(want.minor_to_major)
            and [list(t.dimensions) for t in proto.tiles]
            == [list(t.dimensions) for t in want.tiles]
            and proto.element_size_in_bits == want.element_size_in_bits)


def check_upload_layout(schema: Schema, layout: Message, rank: int,
                        default: str | None) -> None:
    """Accepts the layout an upload names when it is the device's default: row-major, or
    `default` (the backend's, as the client was told it), in either IFRT form."""
    serialized = layout.serialized_layout
    row_major = list(range(rank))
    try:
        if serialized.type_name == "xla::ifrt::CompactLayout":
            proto = schema["xla.ifrt.CompactLayoutProto"].FromString(serialized.data)
            if list(proto.major_to_minor) in ([], row_major):
                return
        elif serialized.type_name == "xla::ifrt::PjRtLayout":
            proto = schema["xla.ifrt.PjRtLayoutProto"].FromString(serialized.data)
            xla = proto.xla_layout
            minor_to_major = list(xla.minor_to_major)
            if minor_to_major in ([], row_major[::-1]) and not xla.tiles:
                return
            if default is not None and same(xla, default, schema["xla.LayoutProto"]):
                return
        elif not serialized.type_name:
            return
    except Exception:  # noqa: BLE001
        raise errors.InvalidRequest("the array's layout does not parse.") from None
    raise errors.Unimplemented(
        f"custom array layouts ({serialized.type_name}) are not supported by isthmus; use the "
        "device's default layout.")
