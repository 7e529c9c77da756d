"""Arrays kept for a lease's next client (a shared service, `isthmus.shared.keep`).

`keep` and `take` come as plugin programs (`frontend/plugins.py` routes them to
`frontend/persistence.py`): a keep's arguments are kept under the names it gives, by a
session of their own (`KeptArrays.keeper`) that the lease's end closes; a take's outputs are
new arrays of the calling session over the kept arrays' shards. Neither does device work.
`SessionKept` is the part of a `Session` (session.py) that compiles and runs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, Protocol

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, Buffer
from isthmus.controller.executables import Executable, plan_of
from isthmus.controller.session_checkpoints import plugin_info
from isthmus.controller.session_core import Keeper, SessionCore
from isthmus.controller.session_python import dtype_name
from isthmus.transport.records import Aval


class Sharer(Protocol):
    """What keeping and taking arrays need of a session's arrays (`SessionArrays`)."""

    def share(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
              buffers: Sequence[Buffer], error: errors.IsthmusError | None = None) -> Array: ...

    def release(self, arrays: Sequence[Array]) -> None: ...

    def disown(self, array: Array) -> None: ...


class Keeping(Protocol):
    """The session that holds a lease's kept arrays (a `Session`)."""

    @property
    def arrays(self) -> Sharer: ...

    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class KeptSpec:
    """One array of a keep or take: its name, and for a take what the client expects."""

    name: str
    dtype: dtypes.DType | None = None  # take only
    shape: tuple[int, ...] = ()
    sharding: sh.Sharding | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class KeepPlan:
    """`keep` (the call's arguments are kept under the names) or take (its outputs)."""

    keep: bool
    arrays: tuple[KeptSpec, ...]
    private: ClassVar[bool] = True
    on_hosts: ClassVar[bool] = False


class KeptArrays:
    """Arrays a lease keeps for its next client, by name (`isthmus.shared.keep`). They are
    held by a session of their own, which the lease's end closes (freeing them)."""

    def __init__(self, keeper: Keeping) -> None:
        self.keeper = keeper
        self.arrays: dict[str, Array] = {}

    def describe(self) -> dict[str, object]:
        return {name: {"dtype": dtype_name(a.dtype), "shape": list(a.shape),
                       "devices": list(a.sharding.devices)}
                for name, a in self.arrays.items()}

    async def close(self) -> None:
        self.arrays.clear()
        await self.keeper.close()


class SessionKept:
    """Keeping arrays for a lease's next client, and taking them back (a part of `Session`,
    which holds their arrays, a `Sharer`, and their executables, a `Keeper`)."""

    def __init__(self, core: SessionCore, arrays: Sharer, programs: Keeper) -> None:
        self.controller = core.controller
        self.fleet = core.fleet
        self.arrays = arrays
        self.programs = programs

    def compile(self, plan: KeepPlan) -> Executable:
        device_ids = tuple(dict.fromkeys(d for a in plan.arrays if a.sharding is not None
                                         for d in a.sharding.devices))
        # A keep names no devices (its arguments do): it is the session's, on its first one.
        devices = (self.fleet.devices_of(device_ids) if device_ids
                   else tuple(self.fleet.devices[:1]))
        outputs = () if plan.keep else tuple(
            Aval(a.dtype, a.shape) for a in plan.arrays)  # type: ignore[arg-type]
        info = plugin_info("isthmus_keep" if plan.keep else "isthmus_take", outputs, plan)
        executable = self.controller.executable(plan, devices, info)
        self.programs.keep(executable)
        return executable

    def run(self, executable: Executable, args: Sequence[Array], kept: KeptArrays | None
                 ) -> tuple[list[Array], Callable[[], Awaitable[None]]]:
        plan = plan_of(executable, KeepPlan)
        if kept is None:
            raise errors.Unimplemented(
                "keeping arrays for a later client needs a lease of a shared service "
                "(isthmus.shared.connect); on a server of your own, keep the process.")
        if plan.keep:
            if len(args) != len(plan.arrays):
                raise errors.InvalidRequest(f"keep names {len(plan.arrays)} arrays but "
                                            f"{len(args)} were given.")
            for spec, given in zip(plan.arrays, args):
                old = kept.arrays.pop(spec.name, None)
                if old is not None:
                    kept.keeper.arrays.disown(old)
                    # In this session's order: after its earlier work.
                    self.arrays.release([old])
                kept.arrays[spec.name] = kept.keeper.arrays.share(
                    given.dtype, given.shape, given.sharding, given.shards, given.error)
            outputs: list[Array] = []
        else:
            if args:
                raise errors.InvalidRequest("take takes no arrays.")
            outputs = []
            for spec in plan.arrays:
                array = kept.arrays.get(spec.name)
                if array is None:
                    self.arrays.release(outputs)
                    raise errors.UnknownHandle(
                        f"no array is kept under {spec.name!r} for this lease (kept: "
                        f"{sorted(kept.arrays)[:8]}); keep it first, within the same lease.")
                assert spec.sharding is not None
                if (array.dtype != spec.dtype or array.shape != spec.shape or
                        sh.shard_boxes(array.sharding, array.shape) != sh.shard_boxes(
                            spec.sharding, spec.shape) or
                        tuple(array.sharding.devices) != tuple(spec.sharding.devices)):
                    self.arrays.release(outputs)
                    raise errors.InvalidRequest(
                        f"{spec.name!r} is kept as {dtype_name(array.dtype)}"
                        f"{list(array.shape)} on devices {list(array.sharding.devices)}; take "
                        "it with that dtype, shape and sharding.")
                outputs.append(self.arrays.share(array.dtype, array.shape, array.sharding,
                                                 array.shards, array.error))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)

        async def status() -> None:
            await done
        return outputs, status
