"""pathwaysutils' persistence: arrays saved and restored by the hosts that hold them.

With `ENABLE_PATHWAYS_PERSISTENCE=1`, orbax saves through pathwaysutils, which sends a plugin
program naming a location, an array name, its sharding and devices per array. Its "execute"
here asks each host to write (or read) its own shards (`worker/persistence.py` has the
format); the controller only plans who writes which box and never sees the bytes.

A write is two phases: every distinct box is written by the host of the first device that
holds it, then the host of the array's first device writes the index (`meta.json`), so an
array directory with an index is complete. A host lost during a save fails it with
DATA_LOSS; what was saved before (another directory) is untouched. `SessionCheckpoints` is
the part of a `Session` (session.py) that plans them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, cast

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, first_error, groups_of
from isthmus.controller.executables import Executable, plan_of
from isthmus.controller.session_core import Keeper, Owner, SessionCore, as_error
from isthmus.controller.session_python import default_layout, dtype_name, finish, settle_after
from isthmus.ids import BufferId, WorkerId
from isthmus.transport import commands as c
from isthmus.transport.records import Aval, CompiledInfo


@dataclasses.dataclass(frozen=True, slots=True)
class Saved:
    """One array of a persistence program."""

    location: str  # the array's directory: the request's location / name
    dtype: dtypes.DType | None  # None for writes: the array given to the call decides
    shape: tuple[int, ...]
    sharding: sh.Sharding


@dataclasses.dataclass(frozen=True, slots=True)
class PersistencePlan:
    """A write (the arrays are the call's arguments) or a read (its outputs)."""

    write: bool
    arrays: tuple[Saved, ...]
    private: ClassVar[bool] = True  # the session's own executable (`Controller.executable`)
    on_hosts: ClassVar[bool] = False  # nothing to load on the workers


class SessionCheckpoints:
    """Checkpoint writes and reads done by the workers (a part of `Session`, which makes
    what a read restores through its arrays, an `Owner`, and holds the plans' executables,
    a `Keeper`)."""

    def __init__(self, core: SessionCore, arrays: Owner, programs: Keeper) -> None:
        self.core = core
        self.controller = core.controller
        self.fleet = core.fleet
        self.dispatcher = core.dispatcher
        self.arrays = arrays
        self.programs = programs

    def compile(self, plan: PersistencePlan) -> Executable:
        files = self.core.files
        if files is not None:  # a shared service's tenant: its own storage root only
            plan = dataclasses.replace(plan, arrays=tuple(
                dataclasses.replace(a, location=files.resolve(a.location, "a checkpoint"))
                for a in plan.arrays))
        device_ids = tuple(dict.fromkeys(d for a in plan.arrays for d in a.sharding.devices))
        devices = self.fleet.devices_of(device_ids)
        outputs = () if plan.write else tuple(
            Aval(a.dtype, a.shape) for a in plan.arrays)  # type: ignore[arg-type]
        info = plugin_info("persistence_write" if plan.write else "persistence_read",
                           outputs, plan)
        executable = self.controller.executable(plan, devices, info)
        self.programs.keep(executable)
        return executable

    def run(self, executable: Executable, args: Sequence[Array]
            ) -> tuple[list[Array], Callable[[], Awaitable[None]]]:
        plan = plan_of(executable, PersistencePlan)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if plan.write:
            outputs: list[Array] = []
            self._plan_write(plan, args, done)
        else:
            if args:
                raise errors.InvalidRequest("a persistence read takes no arrays.")
            outputs = self._plan_read(plan, done)

        async def status() -> None:
            await asyncio.shield(done)

        return outputs, status

    # ---- writes --------------------------------------------------------------------------

    def _plan_write(self, plan: PersistencePlan, args: Sequence[Array],
                    done: asyncio.Future[None]) -> None:
        if len(args) != len(plan.arrays):
            raise errors.InvalidRequest(
                f"the write names {len(plan.arrays)} arrays but {len(args)} were given.")
        for index, (array, saved) in enumerate(zip(args, plan.arrays)):
            if array.shape != saved.shape or set(array.sharding.devices) != set(
                    saved.sharding.devices):
                raise errors.InvalidRequest(
                    f"array {index} is {list(array.shape)} on devices "
                    f"{list(array.sharding.devices)}, not what the write request names "
                    f"({list(saved.shape)} on {list(saved.sharding.devices)}).")

        def run() -> None:
            error = first_error(args)
            if error is not None:
                finish((), done, error)
                return
            writes: dict[WorkerId, list[tuple[str, list[tuple[BufferId, sh.Box]]]]] = {}
            metas = []
            for array, saved in zip(args, plan.arrays):
                boxes = sh.shard_boxes(array.sharding, array.shape)
                seen: set[sh.Box] = set()
                per_worker: dict[WorkerId, list[tuple[BufferId, sh.Box]]] = {}
                for buffer, box in zip(array.shards, boxes):
                    if box not in seen:
                        seen.add(box)
                        per_worker.setdefault(buffer.device.worker, []).append((buffer.id, box))
                for worker, items in per_worker.items():
                    writes.setdefault(worker, []).append((saved.location, items))
                dtype = dtype_name(array.dtype)
                metas.append((array.shards[0].device.worker, saved.location, dtype,
                              array.shape, tuple(seen)))
            waits = [self.fleet.channel(w).ask(
                         c.WriteShards(location, tuple(items)))
                     for w, jobs in writes.items() for location, items in jobs]
            self.core.spawn(self._finish_write(waits, metas, done))

        self.dispatcher.submit(groups_of(args), run)

    async def _finish_write(self, waits: Sequence[Awaitable[int]], metas: list,
                            done: asyncio.Future[None]) -> None:
        try:
            await asyncio.gather(*waits)
            await asyncio.gather(*(self.fleet.channel(w).ask(
                                       c.WriteMeta(loc, dtype, tuple(shape), tuple(boxes)))
                                   for w, loc, dtype, shape, boxes in metas))
        except Exception as e:  # noqa: BLE001
            finish((), done, as_error(e, "saving the checkpoint"))
            return
        finish((), done, None)

    # ---- reads ---------------------------------------------------------------------------

    def _plan_read(self, plan: PersistencePlan, done: asyncio.Future[None]) -> list[Array]:
        outputs = []
        for aval, sharding, nbytes in executable_specs(plan):
            group = self.controller.ledger.new_group(self.fleet.devices_of(sharding.devices),
                                                     nbytes, definers=1)
            outputs.append(self.arrays.own(aval.dtype, aval.shape, sharding, group))
        groups = [out.group for out in outputs]

        def run() -> None:
            error = self.fleet.unavailable(
                d for g in groups for d in g.devices)  # type: ignore[union-attr]
            if error is not None:
                finish(groups, done, error)
                return
            waits: list[Awaitable[None]] = []
            for out, saved in zip(outputs, plan.arrays):
                boxes = sh.shard_boxes(saved.sharding, saved.shape)
                per_worker: dict[WorkerId, list[tuple[BufferId, int, sh.Box]]] = {}
                for buffer, box in zip(out.shards, boxes):
                    per_worker.setdefault(buffer.device.worker, []).append(
                        (buffer.id, buffer.device.id, box))
                dtype = dtype_name(saved.dtype)  # type: ignore[arg-type]
                waits.extend(self.fleet.channel(w).ask(c.ReadShards(
                                 saved.location, dtype, tuple(saved.shape), tuple(items)))
                             for w, items in per_worker.items())
            self.core.spawn(settle_after(groups, done, waits, "restoring the checkpoint"))

        self.dispatcher.submit((), run)
        return outputs


def plugin_info(name: str, outputs: tuple[Aval, ...], plan: object) -> CompiledInfo:
    """What the client learns of a plugin program that runs nothing on the devices."""
    return CompiledInfo(
        name=name, params=(), outputs=outputs, param_shardings=None, output_shardings=None,
        param_layouts=(), output_layouts=tuple(default_layout(a.shape) for a in outputs),
        output_memory_kinds=("",) * len(outputs), donated_inputs=(),
        fingerprint=hashlib.sha256(repr(plan).encode()).digest(),
        memory_stats={}, generated_code_bytes=0)


def executable_specs(plan: PersistencePlan) -> list[tuple[Aval, sh.Sharding, tuple[int, ...]]]:
    # A read plan's: each array's dtype is known (None only in writes).
    return [(Aval(cast(dtypes.DType, a.dtype), a.shape), a.sharding,
             sh.shard_nbytes(a.sharding, a.shape, cast(dtypes.DType, a.dtype).itemsize))
            for a in plan.arrays]
