"""A simulated accelerator: programs take wall time on their devices, but no CPU.

On a small CPU machine the dispatch threshold (the smallest step at which isthmus keeps up
with local jax) measures contention: XLA's CPU compute, the client, the controller and the
workers share the cores. A `SimulatedHost` takes the compute out. Each program runs for real
once (its first call, which also gives its outputs' shapes, shardings and memory kinds);
every later call is not computed at all: its outputs are the first call's buffers again,
counted as computed only once the call's simulated run is over. A run lasts the program's
FLOPs per device (XLA's cost analysis) divided by the simulated rate, and starts when its
devices are free and its inputs are computed, so the devices behave like accelerators
running one stream each, in the background.

Results after the first call are therefore wrong by design: this is for benchmarks
(`isthmus up --simulate-flops`, `python -m bench`), never for training.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray, JaxlibClient, JaxlibDevice, JaxSharding
from isthmus.ids import BufferId, ExecutableId
from isthmus.transport.host import Part
from isthmus.worker import programs
from isthmus.worker.buffers import ids_of
from isthmus.worker.colocated import Program
from isthmus.worker.compile_cache import CompileCache, KeptExecutables
from isthmus.worker.host import DeviceHost
from isthmus.worker.slots import Failed, Loaded, Slot

__all__ = ["SimulatedHost", "make_host"]


def make_host(client: JaxlibClient, device_map: dict[int, int] | None = None,
              simulate_flops: float = 0.0,
              compile_cache: CompileCache | KeptExecutables | None = None,
              companions: dict[int, JaxlibDevice] | None = None) -> DeviceHost:
    """The host of a client: a `SimulatedHost` at `simulate_flops` FLOP/s per device when
    that is set, else a `DeviceHost`; `compile_cache` keeps its executables across
    restarts; `companions` are its colocated CPU devices (`DeviceHost`)."""
    if simulate_flops:
        return SimulatedHost(client, device_map, flops_per_s=simulate_flops,
                             compile_cache=compile_cache, companions=companions)
    return DeviceHost(client, device_map, compile_cache=compile_cache, companions=companions)


def _real(value: Slot | None) -> Slot | None:
    return value.value if isinstance(value, _Pending) else value


class _Pending:
    """An output of a simulated run: a real buffer that counts as computed from `ready_at`
    (monotonic seconds) on. It answers what a `DeviceHost` asks of a jax array."""

    __slots__ = ("value", "ready_at")

    def __init__(self, value: JaxArray, ready_at: float) -> None:
        self.value = value
        self.ready_at = ready_at

    def is_ready(self) -> bool:
        return time.monotonic() >= self.ready_at and self.value.is_ready()

    def block_until_ready(self) -> _Pending:
        delay = self.ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self.value.block_until_ready()
        return self

    def is_deleted(self) -> bool:
        return self.value.is_deleted()

    def devices(self) -> set[JaxlibDevice]:
        return self.value.devices()

    @property
    def sharding(self) -> JaxSharding:
        return self.value.sharding

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def nbytes(self) -> int:
        return self.value.nbytes

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None
                  ) -> np.ndarray:
        self.block_until_ready()
        value = np.asarray(self.value)
        return value if dtype is None else value.astype(dtype)


class SimulatedHost(DeviceHost):
    """A `DeviceHost` whose programs are simulated after their first call (see the module
    docstring); `flops_per_s` is the simulated rate of each device."""

    def __init__(self, client: JaxlibClient, device_map: dict[int, int] | None = None, *,
                 flops_per_s: float, **kwargs: Any) -> None:
        if flops_per_s <= 0:
            raise ValueError(f"the simulated rate must be positive, not {flops_per_s}")
        super().__init__(client, device_map, **kwargs)
        self.flops_per_s = flops_per_s
        # Invariant: a device runs one simulated program at a time; it is busy until then.
        self._busy: dict[int, float] = {}
        # Per program that ran once for real: (seconds per run, its outputs' shards).
        self._templates: dict[ExecutableId, tuple[float, list[list[Slot | None]]]] = {}

    def execute(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
                results: Sequence[int], copy_first: frozenset[int] = frozenset()) -> None:
        loaded = self._executables.get(executable_id)
        template = self._templates.get(executable_id)
        if template is None or not isinstance(loaded, Loaded):
            self._first_run(executable_id, args, results, loaded)
            return
        seconds, outputs = template
        positions = loaded.positions
        start = time.monotonic()
        for position in positions:
            start = max(start, self._busy.get(loaded.devices[position].id, 0.0))
        try:
            for buffer_id in self._ids(args, positions):
                value = self.buffers.value(buffer_id)
                if isinstance(value, _Pending):
                    start = max(start, value.ready_at)
        except Exception as e:  # noqa: BLE001 - a failed or missing input fails the outputs
            error = errors.from_runtime_error(e, errors.ExecutionError, "execution failed")
            for base in results:
                for p in positions:
                    self.fail(BufferId(base + p), error)
            return
        end = start + seconds
        for position in positions:
            self._busy[loaded.devices[position].id] = end
        for base, shards in zip(results, outputs):
            for p, shard in zip(positions, shards):
                self.buffers.store(BufferId(base + p), _Pending(shard, end))

    def _first_run(self, executable_id: ExecutableId, args: Sequence[int | Sequence[BufferId]],
                   results: Sequence[int], loaded: Program | None) -> None:
        """Runs the program for real and keeps its outputs as the template of later runs.
        No argument is donated (its buffer may be a template of another program)."""
        positions = loaded.positions if isinstance(loaded, Loaded) else ()
        made = [BufferId(base + p) for base in results for p in positions]
        with self._settled(self._ids(args, positions), made):
            super().execute(executable_id, args, results, frozenset(range(len(args))))
        self.collectives.in_flight.clear()  # no XLA rendezvous waits behind a simulated run
        if not isinstance(loaded, Loaded):
            return
        outputs = [[_real(self.buffers.slot(BufferId(base + p))) for p in loaded.positions]
                   for base in results]
        if any(isinstance(s, Failed) or s is None for shards in outputs for s in shards):
            return  # a failed run is no template; the next call runs for real again
        flops = float(programs.cost_analysis(loaded.executable).get("flops", 0.0) or 0.0)
        self._templates[executable_id] = (max(flops, 0.0) / self.flops_per_s, outputs)

    @staticmethod
    def _ids(args: Sequence[int | Sequence[BufferId]], positions: Sequence[int]
             ) -> list[BufferId]:
        return [b for ref in args for b in ids_of(ref, positions)]

    def drop_executable(self, executable_id: ExecutableId) -> None:
        self._templates.pop(executable_id, None)
        super().drop_executable(executable_id)

    # Operations that read buffers with jax see the real buffer; what they make from a
    # simulated output is computed no earlier than that output.

    def copy(self, src: BufferId, dst: BufferId, device_id: int,
             memory_kind: str | None = None) -> None:
        with self._settled([src], [dst]):
            super().copy(src, dst, device_id, memory_kind)

    def assemble(self, dst: BufferId, device_id: int, memory_kind: str | None,
                 dtype: np.dtype | type[object] | None, shape: tuple[int, ...],
                 parts: Sequence[Part]) -> None:
        with self._settled([src for src, _, _ in parts], [dst]):
            super().assemble(dst, device_id, memory_kind, dtype, shape, parts)

    def bitcast(self, src: BufferId, dst: BufferId, dtype: np.dtype | type[object],
                shape: tuple[int, ...]) -> None:
        with self._settled([src], [dst]):
            super().bitcast(src, dst, dtype, shape)

    @contextlib.contextmanager
    def _settled(self, sources: Sequence[BufferId], made: Sequence[BufferId] = ()
                 ) -> Iterator[None]:
        """Within: `sources` hold their real buffers. After: `made` count as computed no
        earlier than the latest simulated source."""
        pending = {b: v for b in sources if isinstance(v := self.buffers.slot(b), _Pending)}
        for buffer_id, value in pending.items():
            self.buffers.store(buffer_id, value.value)
        try:
            yield
        finally:
            for buffer_id, value in pending.items():
                if self.buffers.slot(buffer_id) is value.value:
                    self.buffers.store(buffer_id, value)
            if pending:
                ready_at = max(v.ready_at for v in pending.values())
                for buffer_id in made:
                    value = self.buffers.slot(buffer_id)
                    if value is not None and not isinstance(value, (Failed, _Pending)):
                        self.buffers.store(buffer_id, _Pending(value, ready_at))
