"""Controller scaling: programs dispatched per second against simulated fleets.

The controller is driven in-process, exactly as the front end drives it, over a fleet of
N hosts whose workers are stand-ins: they take commands and answer requests at once, doing
no device work. A program spans every host (one device each), so one dispatch costs the
controller one command per host. The number that matters is how throughput falls as N grows:
one message per involved host, no per-host round trips.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from isthmus import dtypes
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import Device, Fleet
from isthmus.controller.session import Session
from isthmus.controller.sharding import Sharding, ShardingKind
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.worker.programs import Aval, CompiledInfo, CompileRequest

F32 = dtypes.BY_KIND["KIND_F32"]


class StandInWorker:
    """Accepts every command; answers requests immediately."""

    def __init__(self) -> None:
        self.commands = 0

    async def _ok(self, value: Any = None) -> Any:
        return value

    def put(self, *args: Any, **kwargs: Any) -> Any:
        self.commands += 1
        return self._ok()

    def compile(self, executable_id: Any, request: Any) -> Any:
        self.commands += 1
        aval = Aval(F32, (len(request.device_ids),))
        return self._ok(CompiledInfo(
            name="standin", params=(aval,), outputs=(aval,), param_shardings=None,
            output_shardings=None, param_layouts=("{0}",), output_layouts=("{0}",),
            output_memory_kinds=("device",), donated_inputs=(), fingerprint=None,
            cost_analysis={}, hlo_text="", memory_stats={}, generated_code_bytes=0))

    def ready(self, *args: Any) -> Any:
        return self._ok()

    def fetch(self, *args: Any) -> Any:
        return self._ok(np.zeros(1, np.float32))

    def stats(self) -> dict[str, int]:
        return {}

    def execute(self, *args: Any, **kwargs: Any) -> None:
        self.commands += 1

    def __getattr__(self, name: str) -> Any:
        def command(*args: Any, **kwargs: Any) -> None:
            self.commands += 1
        return command


async def programs_per_second(hosts: int, seconds: float) -> float:
    workers = {WorkerId(h): StandInWorker() for h in range(hosts)}
    devices = [Device(DeviceId(h), WorkerId(h), 0, "cpu", "cpu", SliceId(0), h)
               for h in range(hosts)]
    controller = Controller(Fleet(devices, workers))  # type: ignore[arg-type]
    session = Session(controller)
    ids = tuple(range(hosts))
    executable = session.compile(CompileRequest(b"", b"", ids))
    await executable.compiled
    replicated = Sharding(ShardingKind.HLO, ids)
    x = session.make_array(F32, (hosts,), replicated, _ready(np.zeros(hosts, np.float32)))
    await asyncio.sleep(0)
    count = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            outputs, _ = session.execute(executable, [x])
            session.release([x])
            x = outputs[0]
        count += 20
        await asyncio.sleep(0)  # let batches go out, as the real loop would
    rate = count / (time.perf_counter() - start)
    await session.close()
    return rate


async def _ready(value: np.ndarray) -> np.ndarray:
    return value


def run(host_counts: list[int], seconds: float) -> dict[int, float]:
    return {n: asyncio.run(programs_per_second(n, seconds)) for n in host_counts}


if __name__ == "__main__":
    for n, rate in run([16, 64, 256, 1024], 1.0).items():
        print(f"{n:5d} hosts: {rate:10.0f} programs/s")
