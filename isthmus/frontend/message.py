"""The type of IFRT proxy messages in the front end.

Message classes are built at runtime from the installed jaxlib's descriptors
(`protocol/schema.py`): there are no generated stubs for the type checker to read. A
`Message` is any protobuf message of the schema. The protobuf methods the front end calls
are typed here; a field (and so everything read through it) is untyped, which is where the
schema's own checks take over: protobuf refuses a value of the wrong type when it is set.
"""

from __future__ import annotations

from typing import Any, Protocol


class Message(Protocol):
    """A protobuf message of the IFRT proxy schema."""

    def __getattr__(self, field: str) -> Any: ...

    def __setattr__(self, field: str, value: Any) -> None: ...

    def HasField(self, field: str) -> bool: ...

    def WhichOneof(self, oneof: str) -> str | None: ...

    def SetInParent(self) -> None: ...

    def SerializeToString(self, *, deterministic: bool = ...) -> bytes: ...
