"""Controller scaling: programs dispatched per second against simulated fleets.

The controller is driven in-process, exactly as the front end drives it, over a fleet of
N hosts whose workers are stand-ins: the controller's real channel to a worker process
(`RemoteWorker`: batching, message encoding) with a stream that only counts the bytes, and
requests answered at once. No device work is done. A program spans every host (one device
each) and its output of the step before is released, so each step costs the controller one
Execute and one Free for every host. The number that matters is how throughput falls as N
grows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from isthmus import dtypes
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.controller.session import Session
from isthmus.controller.session_arrays import HostData
from isthmus.controller.sharding import Sharding, ShardingKind
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.records import Aval, CompiledInfo, CompileRequest
from isthmus.transport.remote import RemoteWorker

F32 = dtypes.BY_KIND["KIND_F32"]


class StandInWorker(RemoteWorker):
    """A worker's channel whose stream only keeps the frames; requests are answered at once."""

    def __init__(self, slot: int) -> None:
        self.frames: list[bytes] = []
        register = m.Register(m.PROTOCOL_VERSION, 0, 1, "cpu", "cpu", "stand-in:0", "stand-in",
                              0)
        super().__init__(WorkerId(slot), register, self.frames.append, "stand-in:0")

    def executes(self) -> int:
        """Execute commands received (shared ones decoded)."""
        count = 0
        for frame in self.frames:
            for command in m.decode(frame).commands:
                inner = m.decode(command.data) if isinstance(command, m.Shared) else (command,)
                count += sum(isinstance(x, c.Execute) for x in inner)
        return count

    async def _answer(self, value: Any) -> Any:
        return value

    def ask(self, request: Any) -> Any:
        if isinstance(request, c.Compile):
            aval = Aval(F32, (len(request.program.device_ids),))
            return self._answer(CompiledInfo(
                name="standin", params=(aval,), outputs=(aval,), param_shardings=None,
                output_shardings=None, param_layouts=("{0}",), output_layouts=("{0}",),
                output_memory_kinds=("device",), donated_inputs=(), fingerprint=None,
                memory_stats={}, generated_code_bytes=0))
        if isinstance(request, (c.Put, c.Ready)):
            return self._answer(None)
        return super().ask(request)


async def programs_per_second(hosts: int, seconds: float, per_turn: int = 1) -> float:
    """Programs per second over `hosts` stand-in hosts, issuing `per_turn` programs in each
    event-loop turn (1 is how requests arrive through gRPC: one per turn)."""
    workers = {WorkerId(h): StandInWorker(h) for h in range(hosts)}
    devices = [Device(DeviceId(h), WorkerId(h), 0, "cpu", "cpu", SliceId(0), h)
               for h in range(hosts)]
    controller = Controller(WholeFleet(devices, workers))  # type: ignore[arg-type]
    session = Session(controller)
    ids = tuple(range(hosts))
    executable = session.programs.compile(CompileRequest(b"", b"", ids))
    await executable.compiled
    replicated = Sharding(ShardingKind.HLO, ids)
    x = session.arrays.make_array(F32, (hosts,), replicated, HostData(np.zeros(hosts, np.float32)))
    await asyncio.sleep(0)
    count = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(per_turn):
            outputs, _ = session.programs.execute(executable, [x])
            session.arrays.release([x])
            x = outputs[0]
        count += per_turn
        await asyncio.sleep(0)  # let batches go out, as the real loop would
    controller.fleet.flush()  # what is still waiting to go out counts too
    for worker in workers.values():  # ... also in a channel (behind a free that waited)
        worker.flush()
    rate = count / (time.perf_counter() - start)
    for worker in (workers[WorkerId(0)], workers[WorkerId(hosts - 1)]):
        if worker.executes() < count:
            raise RuntimeError(f"a stand-in host got {worker.executes()} of {count} programs")
    await session.close()
    return rate


def run(host_counts: list[int], seconds: float, per_turn: int = 1) -> dict[int, float]:
    return {n: asyncio.run(programs_per_second(n, seconds, per_turn)) for n in host_counts}


if __name__ == "__main__":
    for per_turn in (1, 20):
        rates = run([16, 64, 256, 1024], 1.0, per_turn)
        for n, rate in rates.items():
            print(f"{per_turn:2d} per turn {n:5d} hosts: {rate:10.0f} programs/s "
                  f"({rate / rates[16]:.0%})")
