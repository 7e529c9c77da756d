"""The fuzzer's records: the model of an array and an executable, a finding, a run's
summary, and where each shard of a layout lies (`fuzzer.py` says how they are used)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.integration.fuzz_programs import Program

INTERNAL = 13
F32, S32 = "KIND_F32", "KIND_S32"
ALWAYS_COPY, REUSE_INPUT, DONATE_INPUT = 1, 2, 3


class State(enum.IntEnum):
    """What a read of an array must give; a combination takes the worst."""
    OK = 0  # its model value, bit for bit
    MAYBE = 1  # its model value or a clean error (a sharer was deleted, a mutation ran)
    GONE = 2  # a clean error (deleted, donated, refused)


@dataclasses.dataclass(eq=False)
class Arr:
    """The model of one array the fuzzer holds a handle to."""
    handle: int
    value: np.ndarray  # the global value (its dtype is the array's)
    devices: tuple[int, ...]  # the sharding's device list, in order
    layout: str  # single | tiled | replicated | grid (see fuzz_programs)
    state: State
    family: int  # arrays of one family may share buffers (deleting one may end the others)
    memory: str = ""  # the sharding's memory kind ("" = default)
    big: bool = False  # never read back (checked with CheckValueReady only)

    def __post_init__(self) -> None:
        if self.layout == "grid" and len(self.devices) != 4:
            raise ValueError(f"a grid over {len(self.devices)} devices")


@dataclasses.dataclass(eq=False)
class Exe:
    handle: int
    program: Program
    devices: tuple[int, ...]  # the device assignment, in order
    trusted: bool  # compiled with well-formed options (else its results are only MAYBE)


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # see the module docstring
    label: str  # the episode that found it
    request: str  # the request (text form, shortened)
    response: str  # the response or what went wrong

    def line(self) -> str:
        return f"{self.kind} in {self.label}: {self.request} -> {self.response}"


@dataclasses.dataclass
class Summary:
    requests: int
    seconds: float
    episodes: collections.Counter[str]
    statuses: collections.Counter[int]  # status code -> responses
    findings: list[Finding]
    stopped: str = ""  # why the run ended early, if it did

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def by_kind(self) -> collections.Counter[str]:
        return collections.Counter(f.kind for f in self.findings)

    def distinct(self) -> list[tuple[Finding, int, list[str]]]:
        """One finding per kind and answer (numbers aside; wrong results per episode), with
        how often it was seen and in which episodes."""
        seen: dict[tuple[str, str], list[Any]] = {}
        for f in self.findings:
            key = f.label if f.kind == "wrong_result" else re.sub(r"\d+", "N", f.response)
            entry = seen.setdefault((f.kind, key), [f, 0, []])
            entry[1] += 1
            if f.label not in entry[2]:
                entry[2].append(f.label)
        return [(f, n, labels) for f, n, labels in seen.values()]

    def report(self) -> str:
        lines = [f"{self.requests} requests in {self.seconds:.1f} s ({self.rate:.0f}/s), "
                 f"{sum(self.episodes.values())} episodes, statuses "
                 f"{dict(sorted(self.statuses.items()))}, findings {dict(self.by_kind())}"
                 + (f"; stopped: {self.stopped}" if self.stopped else "")]
        for f, n, labels in self.distinct():
            lines.append(f"  x{n} {f.line()}")
            if len(labels) > 1:
                lines.append(f"      also in: {', '.join(labels[1:8])}")
        return "\n".join(lines)


def short(message: Any, limit: int = 600) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit] + "..."



def shard_groups(layout: str, shape: Sequence[int], n: int
                 ) -> list[tuple[list[int], tuple[slice, ...]]]:
    """(device positions, index box) per distinct shard of a layout, as the stock client
    groups them for MakeArraysFromHostBufferShards."""
    full = tuple(slice(0, d) for d in shape)
    if layout in ("single", "replicated"):
        return [(list(range(n)), full)]
    if layout == "tiled":  # uneven: shorter last tiles, as XLA cuts them
        step = -(-shape[0] // n)
        return [([i], (slice(min(i * step, shape[0]), min((i + 1) * step, shape[0])),
                       *full[1:])) for i in range(n)]
    if layout == "grid":
        if n != 4 or len(shape) != 2:
            raise ValueError(f"a grid over {n} devices of shape {list(shape)}")
        h, w = shape[0] // 2, shape[1] // 2
        return [([2 * r + c], (slice(r * h, (r + 1) * h), slice(c * w, (c + 1) * w)))
                for r in range(2) for c in range(2)]
    raise ValueError(layout)


def shard_values(arr: Arr) -> list[np.ndarray]:
    """The value on each device position of an array, in device-list order."""
    n = len(arr.devices)
    out: list[np.ndarray] = [np.empty(0)] * n
    for positions, box in shard_groups(arr.layout, arr.value.shape, n):
        for p in positions:
            out[p] = arr.value[box]
    return out
