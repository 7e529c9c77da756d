"""Moving data: copies and reshards onto any devices of the fleet, bitcasts, and reading
arrays back (`fetch` to the host, `ready` to wait for them).

Each operation queues on the session's dispatcher behind the arrays it reads; transfers
between workers and host reads finish in background tasks. `SessionMoves` is the part of a
`Session` (session.py) that does them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, Protocol, cast

import numpy as np

from isthmus import dtypes, errors
from isthmus.controller import readahead, reads
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, Buffer, BufferGroup, first_error, groups_of
from isthmus.controller.executables import Executable, OutputSpec, plan_of
from isthmus.controller.session_core import Keeper, SessionCore, as_error
from isthmus.ids import BufferId, WorkerId
from isthmus.transport import commands as c
from isthmus.transport.base import answered
from isthmus.transport.records import Aval, CompiledInfo
from isthmus.transport.remote import RemoteWorker

# The boxes one reshard has pulled to a worker so far: (worker, box) -> (the target buffer
# that received it, the pull's completion); that worker's other targets copy it there.
Pulled = dict[tuple[WorkerId, sh.Box], tuple[Buffer, "asyncio.Future[None]"]]

# A buffer this large moves between two workers of the controller's machine through a file
# of its shared directory (twice the peers' gRPC path for 64 MiB, bench/RESULTS.md).
RELAY_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class ReshardPlan:
    """pathwaysutils' reshard program (`frontend/reshard.py`): its arguments, laid out by
    `sources`, come back as outputs laid out by `targets`, position by position."""

    sources: tuple[sh.Sharding, ...]  # what each argument must be
    targets: tuple[sh.Sharding, ...]  # what each output becomes
    donate: bool  # the arguments are consumed, as by jax.device_put(..., donate=True)
    private: ClassVar[bool] = True  # the session's own executable (`Controller.executable`)
    on_hosts: ClassVar[bool] = False  # nothing to load on the workers


class MoveArrays(Protocol):
    """What moving and reading arrays need of the session's arrays (`SessionArrays`)."""

    def new_array(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
                  *, definers: int = 1) -> Array: ...

    def validate_shape(self, dtype: dtypes.DType, shape: Sequence[int]) -> tuple[int, ...]: ...

    def definer_done(self, buffer: Buffer, error: errors.IsthmusError | None) -> None: ...

    def donate(self, array: Array) -> None: ...

    def donate_in_order(self, array: Array) -> None: ...

    def release(self, arrays: Sequence[Array]) -> None: ...


class SessionMoves:
    """Copying, resharding, bitcasting and reading a session's arrays (a part of `Session`,
    which holds them in its arrays, `MoveArrays`, and a reshard plan's executable in its
    programs, a `Keeper`)."""

    def __init__(self, core: SessionCore, arrays: MoveArrays, programs: Keeper) -> None:
        self.core = core
        self.controller = core.controller
        self.fleet = core.fleet
        self.dispatcher = core.dispatcher
        self.arrays = arrays
        self.programs = programs

    # ---- moving data ---------------------------------------------------------------------

    def copy_arrays(self, arrays: Sequence[Array], device_ids: Sequence[int] | None,
                    memory_kind: str | None, donate: bool = False) -> list[Array]:
        """Copies of `arrays` on other devices (same layout, position by position).

        With `device_ids` None each array keeps its devices (a memory-kind change)."""
        shardings = []
        for array in arrays:
            targets = self.fleet.devices_of(
                array.sharding.devices if device_ids is None else device_ids)
            if len(targets) != len(array.sharding.devices):
                raise errors.InvalidRequest(
                    f"copying an array on {len(array.sharding.devices)} devices to "
                    f"{len(targets)} devices; give as many target devices as the array has.")
            # No memory kind given keeps the array's own (IFRT's WithDeviceAssignment).
            shardings.append(array.sharding.with_devices(
                tuple(d.id for d in targets),
                memory_kind if memory_kind is not None else array.sharding.memory_kind))
        return self.reshard(arrays, shardings, donate)

    def reshard(self, arrays: Sequence[Array], shardings: Sequence[sh.Sharding],
                donate: bool = False) -> list[Array]:
        """Copies of `arrays` laid out by new shardings, on any devices of the fleet."""
        results = []
        for index, (array, sharding) in enumerate(zip(arrays, shardings)):
            if sh.splits(sharding, array.shape):  # shard i of the source to device i
                sharding = sh.even_from(sharding, sh.shard_boxes(array.sharding, array.shape),
                                        array.shape, f"array {index}")
            # Pending on this reshard itself until it has sent (or failed) every shard.
            out = self.arrays.new_array(array.dtype, array.shape, sharding, definers=1)
            self.controller.ledger.poison(out, array.error)
            results.append(out)
        inputs = groups_of(arrays)

        def run() -> None:
            for array, out in zip(arrays, results):
                error = first_error([array])
                src_boxes = sh.shard_boxes(array.sharding, array.shape)
                dst_boxes = sh.shard_boxes(out.sharding, out.shape)
                pulled: Pulled = {}
                for dst, dst_box in zip(out.shards, dst_boxes):
                    if error is None:
                        try:
                            self._reshard_one(array, src_boxes, dst, dst_box, pulled)
                            continue
                        except errors.IsthmusError as e:
                            dst.fail(e)
                    else:
                        dst.fail(error)
                if donate:
                    self.arrays.donate(array)
                assert out.group is not None
                out.group.settle()

        self.dispatcher.submit(inputs, run)
        return results

    def compile_reshard(self, plan: ReshardPlan) -> Executable:
        """The session's executable for a reshard plan. Its devices are its arguments'
        (jaxlib's `execute_sharded` wants each argument to have a shard on each of them)."""
        devices = self.fleet.devices_of(dict.fromkeys(
            d for s in plan.sources for d in s.devices))
        # Dtypes and shapes come with the first call's arguments, so output layouts are
        # unknown here (None: the client then takes each output's default layout).
        info = CompiledInfo(
            name="reshard", params=(), outputs=(), param_shardings=None,
            output_shardings=tuple(s.op_sharding for s in plan.targets), param_layouts=(),
            output_layouts=None, output_memory_kinds=tuple(
                s.memory_kind or "" for s in plan.targets),
            donated_inputs=tuple(range(len(plan.sources))) if plan.donate else (),
            fingerprint=hashlib.sha256(repr(plan).encode()).digest(),
            memory_stats={}, generated_code_bytes=0)
        executable = self.controller.executable(plan, devices, info)
        self.programs.keep(executable)
        return executable

    def run_reshard(self, executable: Executable, args: Sequence[Array],
                    non_donatable: frozenset[int] = frozenset()
                    ) -> tuple[list[Array], Callable[[], Awaitable[None]]]:
        """`reshard` of the arguments to the plan's targets; the status resolves when the
        outputs are computed. The client keeps the first call's output types for later
        calls, so every call must bring arguments of the first call's dtypes and shapes."""
        plan = plan_of(executable, ReshardPlan)
        if len(args) != len(plan.sources):
            raise errors.InvalidRequest(
                f"the reshard program moves {len(plan.sources)} arrays (reshardRequest."
                f"inSharding) but {len(args)} were given.")
        if executable.output_specs is None:
            first = [Aval(a.dtype, a.shape) for a in args]
        else:
            first = [spec.aval for spec in executable.output_specs]
        default_kind = executable.devices[0].memory_kinds[0]
        for index, (array, source, target, aval) in enumerate(
                zip(args, plan.sources, plan.targets, first)):
            if (array.dtype, array.shape) != (aval.dtype, aval.shape):
                raise errors.InvalidRequest(
                    f"argument {index} is {array.dtype.kind}{list(array.shape)} but this "
                    f"reshard program was first called with {aval.dtype.kind}"
                    f"{list(aval.shape)}; compile a reshard program for each signature.")
            for field, sharding in (("inSharding", source), ("outSharding", target)):
                try:
                    sh.shard_boxes(sharding, array.shape)
                except errors.IsthmusError as e:
                    raise errors.InvalidRequest(
                        f"reshardRequest.{field}[{index}] does not fit argument {index} "
                        f"({array.dtype.kind}{list(array.shape)}): {e.message}") from None
            problem = (None if set(array.sharding.devices) == set(source.devices) else
                       f"lives on devices {sorted(array.sharding.devices)}, not "
                       f"{sorted(source.devices)}")
            problem = problem or sh.placement_mismatch(array.sharding, source, array.shape)
            kind = array.sharding.memory_kind or default_kind
            if problem is None and kind != (source.memory_kind or default_kind):
                problem = f"is in memory kind {kind!r}"
            if problem is not None:
                raise errors.InvalidRequest(
                    f"argument {index} {problem}; it does not match reshardRequest."
                    f"inSharding[{index}]. Build the request from the arrays' own shardings.")
        donated = [i for i in range(len(args)) if plan.donate and i not in non_donatable]
        if donated and len(args) > 1:
            _check_shared(args, frozenset(donated))
        outputs = self.reshard(args, plan.targets)
        if executable.output_specs is None:
            executable.output_specs = [OutputSpec(aval, out.sharding, ())
                                       for aval, out in zip(first, outputs)]
        for index in donated:  # after the reshard read them, as a donating device_put
            self.arrays.donate_in_order(args[index])
        computed = self.ready(outputs)
        computed.add_done_callback(  # type: ignore[attr-defined]
            lambda f: f.cancelled() or f.exception())

        async def status() -> None:
            await asyncio.shield(computed)

        return outputs, status

    def _reshard_one(self, array: Array, src_boxes: Sequence[sh.Box], dst: Buffer,
                     dst_box: sh.Box, pulled: Pulled) -> None:
        """Makes `dst` from the array's shards: a local copy or assembly where the worker
        has the data, else a pull from another worker. A replicated target pulls each box
        once per worker (`pulled`) and copies it there to the worker's other devices."""
        channel = self.fleet.channel(dst.device.worker)
        local = [(b, box) for b, box in zip(array.shards, src_boxes)
                 if b.device.worker == dst.device.worker]
        # Prefer the shard already on the target device, then any holding the whole box.
        local.sort(key=lambda pair: pair[0].device.id != dst.device.id)
        for buffer, box in local:
            if box == dst_box:
                channel.send(c.Copy(buffer.id, dst.id, dst.device.id, dst.memory_kind))
                return
            if all(s0 <= d0 and d1 <= s1 for (s0, s1), (d0, d1) in zip(box, dst_box)):
                local = [(buffer, box)]
                break
        pieces = sh.pieces(local, dst_box)
        if sum(n for *_, n in pieces) == math.prod(sh.shard_shape(dst_box)):
            channel.send(c.Assemble(dst.id, dst.device.id, dst.memory_kind,
                                    c.dtype_field(array.dtype.numpy), sh.shard_shape(dst_box),
                                    tuple((b.id, s, d) for b, s, d, _ in pieces)))
            return
        whole = next((b for b, box in zip(array.shards, src_boxes) if box == dst_box), None)
        if whole is not None:  # the same shard on another worker: move it as it is
            earlier = pulled.get((dst.device.worker, dst_box))
            if earlier is not None:
                self._copy_after(earlier[0], earlier[1], dst)
            else:
                pulled[(dst.device.worker, dst_box)] = (dst, self._pull(
                    whole, dst, dst.memory_kind, files=not array.dtype.is_string))
        else:
            self._reshard_from_peers(array, src_boxes, dst, dst_box)

    def _reshard_from_peers(self, array: Array, src_boxes: Sequence[sh.Box], dst: Buffer,
                            dst_box: sh.Box) -> None:
        """Builds `dst` from shards of several workers: the pieces that live elsewhere are
        pulled (worker to worker) into temporary buffers beside `dst` first."""
        dst.group.expect()
        channel = self.fleet.channel(dst.device.worker)
        controller = self.controller
        parts: list[tuple[Buffer, tuple[slice, ...], tuple[slice, ...]]] = []
        temps: list[Buffer] = []
        local: list[Buffer] = []
        pulls = []
        for source, src_slices, dst_slices, _ in sh.pieces(
                list(zip(array.shards, src_boxes)), dst_box):
            if source.device.worker != dst.device.worker:
                temp = Buffer(controller.ledger.new_group((dst.device,), (source.nbytes,),
                                                          definers=1), 0)  # by the pull
                temps.append(temp)
                pulls.append(self._pull(source, temp, None, files=not array.dtype.is_string,
                                        expect=False))
                source = temp
            else:  # read by the Assemble sent later: a delete of the input must wait for it
                controller.ledger.pin(source)
                local.append(source)
            parts.append((source, src_slices, dst_slices))

        async def finish() -> None:
            try:
                await asyncio.gather(*pulls, return_exceptions=True)
                error = next((t.error for t in temps if t.error is not None), None)
                if error is None:
                    channel.send(c.Assemble(dst.id, dst.device.id, dst.memory_kind,
                                            c.dtype_field(array.dtype.numpy),
                                            sh.shard_shape(dst_box),
                                            tuple((b.id, s, d) for b, s, d in parts)))
            finally:
                for source in local:
                    controller.ledger.unpin(source)
            controller.ledger.free_buffers(temps)
            self.arrays.definer_done(dst, error)

        self.core.spawn(finish())

    def _copy_after(self, first: Buffer, pull: asyncio.Future[None], dst: Buffer) -> None:
        """`dst` is a copy of `first` (on the same worker) once `first`'s pull is over;
        `first` stays pinned until the Copy is sent (a delete of it sent meanwhile waits)."""
        dst.group.expect()
        controller = self.controller
        controller.ledger.pin(first)

        def copy(_: object) -> None:
            if first.error is None:
                self.fleet.channel(dst.device.worker).send(
                    c.Copy(first.id, dst.id, dst.device.id, dst.memory_kind))
            controller.ledger.unpin(first)
            self.arrays.definer_done(dst, first.error)

        pull.add_done_callback(copy)

    def _pull(self, src: Buffer, dst: Buffer, memory_kind: str | None, files: bool = False,
              expect: bool = True) -> asyncio.Future[None]:
        """Moves `src` into `dst` on another worker, worker to worker; `dst` is defined (or
        failed) when the transfer completes. Returns that completion. With `files` (a
        numeric array), a large buffer between two workers of the controller's machine goes
        through a file of its shared directory instead (`RemoteWorker.relay`). `expect`:
        the pull is one more definer of `dst`'s group (False: the group counted it when it
        was made)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        source = self.fleet.channel(src.device.worker)
        if expect:
            dst.group.expect()
        if not isinstance(source, RemoteWorker):  # a lost worker's, or in-process: no peer
            self.arrays.definer_done(dst, self.fleet.slice_error_of(src.device.worker))
            done.set_result(None)
            return done
        self.controller.ledger.pin(src)
        target = self.fleet.channel(dst.device.worker)
        work = (source.relay(src.id, target, dst.id, dst.device.id, memory_kind)
                if files and src.nbytes >= RELAY_BYTES else None)
        if work is None:
            work = target.ask(c.Pull(src.id, source.data_address, dst.id, dst.device.id,
                                     memory_kind, source.pull_mac(src.id)))
        self.controller.counts.peer_bytes += src.nbytes

        async def finish() -> None:
            error = None
            try:
                await work
            except Exception as e:  # noqa: BLE001
                error = as_error(e, "moving an array between workers")
            finally:
                self.controller.ledger.unpin(src)
            self.arrays.definer_done(dst, error)
            done.set_result(None)

        self.core.spawn(finish())
        return done

    def bitcast(self, arrays: Sequence[Array],
                specs: Sequence[tuple[dtypes.DType, tuple[int, ...], sh.Sharding]],
                donate: bool = False) -> list[Array]:
        """The same bytes read as other dtypes and shapes (shard by shard)."""
        results = []
        for array, (dtype, shape, sharding) in zip(arrays, specs):
            if tuple(sharding.devices) != tuple(array.sharding.devices):
                raise errors.InvalidRequest(
                    "a bitcast keeps every shard where it is; give the same devices.")
            if dtype.is_string or array.dtype.is_string:
                raise errors.InvalidRequest("string arrays cannot be bitcast.")
            default = self.fleet.device(sharding.devices[0]).memory_kinds[0] \
                if sharding.devices else None
            if (sharding.memory_kind or default) != (array.sharding.memory_kind or default):
                raise errors.InvalidRequest(
                    f"a bitcast keeps every shard where it is, but memory kind "
                    f"{array.sharding.memory_kind!r} was asked to become "
                    f"{sharding.memory_kind!r}; copy the array first.")
            out = self.arrays.new_array(dtype, self.arrays.validate_shape(dtype, shape),
                                        sharding, definers=0)
            if any(a.nbytes != b.nbytes for a, b in zip(array.shards, out.shards)):
                self.arrays.release([out])
                raise errors.InvalidRequest(
                    f"bitcasting {array.dtype.kind}{list(array.shape)} to "
                    f"{dtype.kind}{list(shape)} changes the size of the shards.")
            self.controller.ledger.poison(out, array.error)
            results.append(out)

        def run() -> None:
            for array, out in zip(arrays, results):
                error = first_error([array])
                boxes = sh.shard_boxes(out.sharding, out.shape)
                for src, dst, box in zip(array.shards, out.shards, boxes):
                    if error is not None:
                        dst.fail(error)
                    else:
                        # Not a string array (refused above): it has a numpy dtype.
                        self.fleet.channel(src.device.worker).send(c.Bitcast(
                            src.id, dst.id, c.dtype_name(cast(np.dtype, out.dtype.numpy)),
                            sh.shard_shape(box)))
                if donate:
                    self.arrays.donate(array)

        self.dispatcher.submit(groups_of(arrays), run)
        return results

    def fetch(self, array: Array) -> asyncio.Future[np.ndarray]:
        """Resolves to the whole array on the host (C order; strings as an object array)."""
        result: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()

        def run() -> None:
            error = first_error([array])
            if error is not None:
                result.set_exception(error)
                return
            boxes = sh.shard_boxes(array.sharding, array.shape)
            wanted: dict[sh.Box, Buffer] = {}
            for buffer, box in zip(array.shards, boxes):
                wanted.setdefault(box, buffer)
            fleet = self.fleet
            pieces = [(box, readahead.claim(b)
                       or fleet.channel(b.device.worker).ask(c.Fetch(b.id, b.nbytes)))
                      for box, b in wanted.items()]
            self.controller.counts.fetch_bytes += sum(b.nbytes for b in wanted.values())
            if all(answered(p) for _, p in pieces):  # all on the host already (in-process)
                ready = cast("list[tuple[sh.Box, asyncio.Future[np.ndarray]]]", pieces)
                result.set_result(reads.assembled(array, [(box, p.result()) for box, p in ready]))
                return
            if len(pieces) == 1 and isinstance(pieces[0][1], asyncio.Future):
                # One worker's answer: settled by a callback, with no task in between.
                box, answer = pieces[0]
                cast(asyncio.Future, answer).add_done_callback(  # a Future: checked above
                    lambda f: reads.settle_fetch(array, box, f, result))
                return
            self.core.spawn(reads.assemble_host(array, pieces, result))

        groups = array.groups
        self.dispatcher.submit(groups, run)
        if self.controller.counts.timing:  # only then are dispatches stamped
            result.add_done_callback(lambda f: self._waited(f, groups))
        return result

    def _waited(self, wait: asyncio.Future, groups: Sequence[BufferGroup]) -> None:
        """A client's fetch or readiness wait ended: it times the programs that made the
        groups, if it went well (the metrics' program latency)."""
        if not wait.cancelled() and wait.exception() is None:
            self.controller.counts.waited(groups)

    def ready(self, arrays: Sequence[Array]) -> Awaitable[None]:
        """Resolves when every array is computed; fails with the first error."""
        result: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def run() -> None:
            error = first_error(arrays)
            if error is not None:
                result.set_exception(error)
                return
            by_worker: dict[WorkerId, list[BufferId]] = {}
            storing: dict[int, asyncio.Future[None]] = {}
            for array in arrays:
                if array.group is not None and array.group.all_stored:
                    continue  # host data its workers confirmed ready: nothing to ask
                for buffer in array.shards:
                    group = buffer.group
                    if group.all_stored:
                        continue
                    if group.storing is not None:  # a put's answers are on the way
                        storing[id(group)] = group.storing
                    else:
                        by_worker.setdefault(buffer.device.worker, []).append(buffer.id)
            if by_worker:
                fleet = self.fleet
                waits: list[Awaitable[object]] = [
                    fleet.channel(w).ask(c.Ready(tuple(ids))) for w, ids in by_worker.items()]
                if len(waits) == 1 and not storing and isinstance(waits[0], asyncio.Future):
                    reads.settle_on(waits[0], result, arrays)  # one worker's answer
                else:
                    self.core.spawn(reads.settle(asyncio.gather(*waits, *storing.values()),
                                                 result, arrays))
            elif storing:  # the usual wait after a put: its answers, no task, no question
                reads.settle_when(list(storing.values()), result, arrays)
            else:
                result.set_result(None)

        groups = groups_of(arrays)
        self.dispatcher.submit(groups, run)
        if self.controller.counts.timing:
            result.add_done_callback(lambda f: self._waited(f, groups))
        return result


def _check_shared(args: Sequence[Array], donated: frozenset[int]) -> None:
    """Refuses a donated argument whose buffers another argument also reads."""
    owners: dict[tuple[int, int], int] = {}
    for index, array in enumerate(args):
        for buffer in array.shards:
            other = owners.setdefault((id(buffer.group), buffer.position), index)
            if other != index and (other in donated or index in donated):
                raise errors.InvalidRequest(
                    f"arguments {other} and {index} share buffers and the reshard donates "
                    "one of them; pass a copy as one of them, or do not donate.")
