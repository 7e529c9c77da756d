"""Reading the controller's commands on a worker: shared commands unpacked in place, the
buffers a command makes, pieces of an incoming put, and the shared-directory probe."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from isthmus.transport import messages as m
from isthmus.worker.programs import CompileRequest


@dataclasses.dataclass(slots=True)
class _Incoming:
    buffer: np.ndarray
    device: int
    memory_kind: str | None
    dtype: Any
    shape: tuple[int, ...]


def _reads(path: str, token: str) -> bool:
    """The controller's probe file is here with its contents: we share its machine."""
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def _request(c: m.Compile | m.Load) -> CompileRequest:
    return CompileRequest(c.module, c.compile_options, c.device_ids, c.replicas)


def _unpack(commands: tuple[Any, ...]) -> Iterator[Any]:
    """The commands of a batch, with those shared by several workers decoded in place."""
    for command in commands:
        if isinstance(command, m.Shared):
            yield from m.decode(command.data)
        else:
            yield command


def _produced(command: Any) -> list[int]:
    """The buffers a command would have made (an Execute fails its own outputs)."""
    if isinstance(command, m.Execute):
        return []
    for field in ("dst", "buffer"):
        if hasattr(command, field) and not isinstance(command, (m.Fetch, m.Fail)):
            return [getattr(command, field)]
    return []
