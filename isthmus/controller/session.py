"""One client session's view of the controller: array operations, compilation, execution.

Every method returns at once. Operations that touch workers are queued on the session's
`OrderedDispatcher`; their outcome is either an array (whose errors surface when it is used)
or an awaitable the caller may wait on. Nothing here waits for device work.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import (Array, Buffer, BufferGroup, first_error, groups_of,
                                       whole_group)
from isthmus.controller.controller import Controller, Executable
from isthmus.controller.dispatch import OrderedDispatcher
from isthmus.controller.fleet import Device
from isthmus.ids import BufferId, WorkerId
from isthmus.worker.programs import CompileRequest

logger = logging.getLogger(__name__)


class Session:
    """Arrays and executables of one client session."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.fleet = controller.fleet
        self.dispatcher = OrderedDispatcher()
        self._arrays: set[Array] = set()
        self._executables: list[Executable] = []
        self._tasks: set[asyncio.Task[object]] = set()
        self.closed = False
        controller.sessions.add(self)

    # ---- creating arrays -----------------------------------------------------------------

    def validate_shape(self, dtype: dtypes.DType, shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise errors.InvalidRequest(
                f"shape {shape} has a negative dimension; every dimension must be >= 0.")
        nbytes = math.prod(shape) * max(dtype.itemsize, 1)
        if nbytes > self.controller.config.max_array_bytes:
            raise errors.TooLarge(
                f"an array of shape {shape} and dtype {dtype.kind} needs {nbytes} bytes, over "
                f"the server's limit of {self.controller.config.max_array_bytes} bytes; split "
                "it, or start the server with a larger --max-array-bytes.")
        return shape

    def _new_array(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
                   *, define: bool = True) -> Array:
        devices = self.fleet.devices_of(sharding.devices)
        self._check_memory_kind(devices, sharding.memory_kind)
        nbytes = sh.shard_nbytes(sharding, shape, dtype.itemsize)
        group = self.controller.new_group(devices, nbytes, sharding.memory_kind)
        if define:
            group.expect()
        return self._own(dtype, shape, sharding, group)

    def _own(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
             group: BufferGroup) -> Array:
        """The session's array over a new group (its first holder)."""
        group.refs = 1
        array = Array(dtype, shape, sharding, group)
        self._arrays.add(array)
        return array

    def _check_memory_kind(self, devices: Sequence[Device], kind: str | None) -> None:
        if kind is None:
            return
        for device in devices:
            if kind not in device.memory_kinds:
                raise errors.InvalidRequest(
                    f"memory kind {kind!r} does not exist on device {device.id} (it has "
                    f"{', '.join(device.memory_kinds)}); pick one of those.")

    def make_array(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                   host: Awaitable[np.ndarray]) -> Array:
        """An array whose full contents arrive later as a host array (C order or strided)."""
        shape = self.validate_shape(dtype, shape)
        array = self._new_array(dtype, shape, sharding)
        self._spawn(self._fill(array, host))
        return array

    def make_array_from_shards(self, dtype: dtypes.DType, shape: Sequence[int],
                               sharding: sh.Sharding,
                               pieces: Sequence[tuple[Sequence[int], Awaitable[np.ndarray]]]
                               ) -> Array:
        """An array whose shards arrive as host arrays; `pieces` pairs device positions
        (indices into the sharding's device list) with the data all of them hold."""
        shape = self.validate_shape(dtype, shape)
        array = self._new_array(dtype, shape, sharding, define=False)
        group = array.group
        assert group is not None
        covered: set[int] = set()
        for positions, _ in pieces:
            for p in positions:
                if not 0 <= p < len(group) or p in covered:
                    array.error = errors.InvalidRequest(
                        f"shard index {p} is out of range or given twice for an array with "
                        f"{len(group)} shards; send each shard index once.")
                    group.error = array.error
                    return array
                covered.add(p)
        boxes = sh.shard_boxes(sharding, shape)
        for positions, data in pieces:
            group.expect()
            self._spawn(self._fill_shards(group, list(positions), [boxes[p] for p in positions],
                                          data))
        missing = [p for p in range(len(group)) if p not in covered]
        if missing:
            error = errors.InvalidRequest(
                f"no host data was given for shard(s) {missing[:8]} of the array; every "
                "addressable shard needs data.")
            for p in missing:
                group.set_error(p, error)
        return array

    def make_error_array(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                         error: errors.IsthmusError) -> Array:
        array = self._new_array(dtype, self.validate_shape(dtype, shape), sharding, define=False)
        array.error = error
        assert array.group is not None
        array.group.error = error
        return array

    async def _fill(self, array: Array, host: Awaitable[np.ndarray]) -> None:
        group = array.group
        assert group is not None
        try:
            value = await host
            if tuple(value.shape) != array.shape:
                raise errors.InvalidRequest(
                    f"host data has shape {tuple(value.shape)} but the array has shape "
                    f"{array.shape}; send data matching the declared shape.")
            boxes = sh.shard_boxes(array.sharding, array.shape)
            await self._put(group, range(len(group)), [value[sh.box_slices(b)] for b in boxes])
        except Exception as e:  # noqa: BLE001 - the array carries the failure
            if group.error is None:
                group.error = _as_error(e, "receiving the array's host data")
        group.settle()

    async def _fill_shards(self, group: BufferGroup, positions: list[int], boxes: list[sh.Box],
                           host: Awaitable[np.ndarray]) -> None:
        try:
            value = await host
            for box in boxes:
                if tuple(value.shape) != sh.shard_shape(box):
                    raise errors.InvalidRequest(
                        f"a host shard has shape {tuple(value.shape)} but the sharding puts "
                        f"shape {sh.shard_shape(box)} there; send shards of the shapes the "
                        "sharding implies.")
            await self._put(group, positions, [value] * len(positions))
        except Exception as e:  # noqa: BLE001
            error = _as_error(e, "receiving the array's host data")
            for p in positions:
                if group.error_at(p) is None:
                    group.set_error(p, error)
        group.settle()

    async def _put(self, group: BufferGroup, positions: Sequence[int],
                   values: Sequence[np.ndarray]) -> None:
        """Stores host data at positions of a group; failures stay with their positions."""
        waits, placed = [], []
        for p, value in zip(positions, values):
            if group.freed_position(p):  # released before its data arrived: nothing to store
                continue
            device = group.devices[p]
            placed.append(p)
            waits.append(self.fleet.channel(device.worker).put(
                BufferId(group.base + p), device.id, value, group.memory_kind))
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        for p, outcome in zip(placed, outcomes):
            if isinstance(outcome, BaseException) and group.error_at(p) is None:
                group.set_error(p, _as_error(outcome, "storing host data"))

    def _defined(self, buffer: Buffer, error: errors.IsthmusError | None) -> None:
        """An operation that was to define `buffer` is over (with `error` if it failed)."""
        if error is not None and buffer.error is None:
            buffer.error = error
        buffer.group.settle()

    # ---- arrays over existing buffers ----------------------------------------------------

    def _share(self, dtype: dtypes.DType, shape: tuple[int, ...], sharding: sh.Sharding,
               buffers: Sequence[Buffer], error: errors.IsthmusError | None = None) -> Array:
        group = whole_group(buffers)
        if group is not None:
            group.refs += 1
            array = Array(dtype, shape, sharding, group, error=error)
        else:
            for buffer in buffers:
                shared = buffer.group
                if shared.shard_refs is None:
                    shared.shard_refs = {}
                shared.shard_refs[buffer.position] = shared.shard_refs.get(buffer.position, 0) + 1
            array = Array(dtype, shape, sharding, parts=tuple(buffers), error=error)
        self._arrays.add(array)
        return array

    def disassemble(self, array: Array, donate: bool = False) -> list[Array]:
        """One single-device array per shard, in the order of the sharding's devices."""
        boxes = sh.shard_boxes(array.sharding, array.shape)
        result = [
            self._share(array.dtype, sh.shard_shape(box),
                        sh.Sharding.single(buffer.device.id, array.sharding.memory_kind),
                        [buffer], array.error)
            for buffer, box in zip(array.shards, boxes)]
        if donate:
            self._donate(array)
        return result

    def assemble(self, dtype: dtypes.DType, shape: Sequence[int], sharding: sh.Sharding,
                 parts: Sequence[Array], donate: bool = False) -> Array:
        """An array made of single-device arrays (one per device of `sharding`)."""
        shape = self.validate_shape(dtype, shape)
        boxes = sh.shard_boxes(sharding, shape)
        by_device: dict[int, Array] = {}
        for part in parts:
            if len(part.shards) != 1:
                raise errors.InvalidRequest(
                    "assembling takes single-device arrays, but one of them has "
                    f"{len(part.shards)} shards; disassemble it first.")
            by_device[part.shards[0].device.id] = part
        buffers = []
        for device_id, box in zip(sharding.devices, boxes):
            part = by_device.get(device_id)
            if part is None:
                raise errors.InvalidRequest(
                    f"no single-device array was given for device {device_id} of the "
                    "sharding; pass one array per device of the sharding.")
            if part.shape != sh.shard_shape(box) or part.dtype != dtype:
                raise errors.InvalidRequest(
                    f"the array for device {device_id} has shape {part.shape} and dtype "
                    f"{part.dtype.kind}, but the sharding needs {sh.shard_shape(box)} and "
                    f"{dtype.kind} there.")
            buffers.append(part.shards[0])
        error = first_error(a for a in parts if a.error is not None)
        result = self._share(dtype, shape, sharding, buffers, error)
        if donate:
            for part in parts:
                self._donate(part)
        return result

    def fully_replicated_shard(self, array: Array, donate: bool = False) -> Array:
        if not sh.is_fully_replicated(array.sharding, array.shape):
            raise errors.InvalidRequest(
                "the array is not fully replicated, so no single shard holds all of it; "
                "reshard it to a replicated sharding first.")
        buffer = array.shards[0]
        result = self._share(array.dtype, array.shape,
                             sh.Sharding.single(buffer.device.id, array.sharding.memory_kind),
                             [buffer], array.error)
        if donate:
            self._donate(array)
        return result

    def remap(self, inputs: Sequence[Array],
              outputs: Sequence[tuple[dtypes.DType, tuple[int, ...], sh.Sharding]],
              mappings: Sequence[tuple[int, int, range, range]], donate: bool = False
              ) -> list[Array]:
        """New arrays whose shards are shards of the inputs, as a remap plan says.

        Each mapping is (input index, output index, input shard range, output shard range).
        """
        slots: list[list[Buffer | None]] = [[None] * len(spec[2].devices) for spec in outputs]
        for in_index, out_index, src, dst in mappings:
            if not (0 <= in_index < len(inputs) and 0 <= out_index < len(outputs)):
                raise errors.InvalidRequest(
                    f"the remap plan maps array {in_index} to array {out_index}, outside the "
                    f"{len(inputs)} inputs and {len(outputs)} outputs.")
            if len(src) != len(dst):
                raise errors.InvalidRequest(
                    "a remap plan interval maps a different number of shards than it "
                    "receives; make both intervals the same length.")
            shards = inputs[in_index].shards
            for s, d in zip(src, dst):
                if not (0 <= s < len(shards) and 0 <= d < len(slots[out_index])):
                    raise errors.InvalidRequest(
                        f"the remap plan names shard {s} -> {d}, outside the arrays' shards.")
                slots[out_index][d] = shards[s]
        result = []
        for (dtype, shape, sharding), buffers in zip(outputs, slots):
            if any(b is None for b in buffers):
                raise errors.InvalidRequest(
                    "the remap plan leaves some output shards unmapped; map every shard.")
            for device_id, buffer in zip(sharding.devices, buffers):
                if buffer is not None and buffer.device.id != device_id:
                    raise errors.InvalidRequest(
                        f"the remap plan puts a shard held on device {buffer.device.id} at "
                        f"the place of device {device_id}; remapping cannot move data.")
            error = first_error(a for a in inputs if a.error is not None)
            result.append(self._share(dtype, shape, sharding, buffers, error))  # type: ignore[arg-type]
        if donate:
            for array in inputs:
                self._donate(array)
        return result

    def _donate(self, array: Array) -> None:
        """The input of a DONATE_INPUT operation: unusable afterwards, its buffers live on."""
        array.deleted = True

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
            shardings.append(array.sharding.with_devices(tuple(d.id for d in targets),
                                                         memory_kind))
        return self.reshard(arrays, shardings, donate)

    def reshard(self, arrays: Sequence[Array], shardings: Sequence[sh.Sharding],
                donate: bool = False) -> list[Array]:
        """Copies of `arrays` laid out by new shardings, on any devices of the fleet."""
        results = []
        for array, sharding in zip(arrays, shardings):
            out = self._new_array(array.dtype, array.shape, sharding, define=False)
            out.error = array.error
            results.append(out)
        inputs = groups_of(arrays)

        def run() -> None:
            for array, out in zip(arrays, results):
                error = first_error([array])
                src_boxes = sh.shard_boxes(array.sharding, array.shape)
                dst_boxes = sh.shard_boxes(out.sharding, out.shape)
                for dst, dst_box in zip(out.shards, dst_boxes):
                    if error is None:
                        try:
                            self._reshard_one(array, src_boxes, dst, dst_box)
                            continue
                        except errors.IsthmusError as e:
                            dst.error = e
                    else:
                        dst.error = error
                if donate:
                    self._donate(array)

        self.dispatcher.submit(inputs, run)
        return results

    def _reshard_one(self, array: Array, src_boxes: Sequence[sh.Box], dst: Buffer,
                     dst_box: sh.Box) -> None:
        channel = self.fleet.channel(dst.device.worker)
        local = [(b, box) for b, box in zip(array.shards, src_boxes)
                 if b.device.worker == dst.device.worker]
        # Prefer the shard already on the target device, then any holding the whole box.
        local.sort(key=lambda c: c[0].device.id != dst.device.id)
        for buffer, box in local:
            if box == dst_box:
                channel.copy(buffer.id, dst.id, dst.device.id, dst.memory_kind)
                return
            if all(s0 <= d0 and d1 <= s1 for (s0, s1), (d0, d1) in zip(box, dst_box)):
                local = [(buffer, box)]
                break
        pieces = _pieces(local, dst_box)
        if sum(n for *_, n in pieces) == math.prod(sh.shard_shape(dst_box)):
            channel.assemble(dst.id, dst.device.id, dst.memory_kind, array.dtype.numpy,
                             sh.shard_shape(dst_box), [(b.id, s, d) for b, s, d, _ in pieces])
            return
        whole = next((b for b, box in zip(array.shards, src_boxes) if box == dst_box), None)
        if whole is not None:  # the same shard on another worker: move it as it is
            self._pull(whole, dst, dst.memory_kind)
        else:
            self._reshard_from_peers(array, src_boxes, dst, dst_box)

    def _reshard_from_peers(self, array: Array, src_boxes: Sequence[sh.Box], dst: Buffer,
                            dst_box: sh.Box) -> None:
        """Builds `dst` from shards of several workers: the pieces that live elsewhere are
        pulled (worker to worker) into temporary buffers beside `dst` first."""
        dst.group.expect()
        channel = self.fleet.channel(dst.device.worker)
        parts: list[tuple[Buffer, tuple[slice, ...], tuple[slice, ...]]] = []
        temps: list[Buffer] = []
        pulls = []
        for source, src_slices, dst_slices, _ in _pieces(
                list(zip(array.shards, src_boxes)), dst_box):
            if source.device.worker != dst.device.worker:
                temp = Buffer(self.controller.new_group((dst.device,), (source.nbytes,)), 0)
                temps.append(temp)
                pulls.append(self._pull(source, temp, None))
                source = temp
            parts.append((source, src_slices, dst_slices))

        async def finish() -> None:
            await asyncio.gather(*pulls, return_exceptions=True)
            error = next((t.error for t in temps if t.error is not None), None)
            if error is None:
                channel.assemble(dst.id, dst.device.id, dst.memory_kind, array.dtype.numpy,
                                 sh.shard_shape(dst_box), [(b.id, s, d) for b, s, d in parts])
            self.controller.free_buffers(temps)
            self._defined(dst, error)

        self._spawn(finish())

    def _pull(self, src: Buffer, dst: Buffer, memory_kind: str | None) -> asyncio.Future[None]:
        """Moves `src` into `dst` on another worker, worker to worker; `dst` is defined (or
        failed) when the transfer completes. Returns that completion."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        source = self.fleet.channel(src.device.worker)
        address = getattr(source, "data_address", None)
        if address is None:
            if dst.error is None:
                dst.error = self.fleet.slice_error_of(src.device.worker)
            done.set_result(None)
            return done
        dst.group.expect()
        self.controller.pin(src)
        work = self.fleet.channel(dst.device.worker).pull(
            src.id, address, dst.id, dst.device.id, memory_kind)

        async def finish() -> None:
            error = None
            try:
                await work
            except Exception as e:  # noqa: BLE001
                error = _as_error(e, "moving an array between workers")
            finally:
                self.controller.unpin(src)
            self._defined(dst, error)
            done.set_result(None)

        self._spawn(finish())
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
            out = self._new_array(dtype, self.validate_shape(dtype, shape), sharding,
                                  define=False)
            if any(a.nbytes != b.nbytes for a, b in zip(array.shards, out.shards)):
                self.release([out])
                raise errors.InvalidRequest(
                    f"bitcasting {array.dtype.kind}{list(array.shape)} to "
                    f"{dtype.kind}{list(shape)} changes the size of the shards.")
            out.error = array.error
            results.append(out)

        def run() -> None:
            for array, out in zip(arrays, results):
                error = first_error([array])
                boxes = sh.shard_boxes(out.sharding, out.shape)
                for src, dst, box in zip(array.shards, out.shards, boxes):
                    if error is not None:
                        dst.error = error
                    else:
                        self.fleet.channel(src.device.worker).bitcast(
                            src.id, dst.id, out.dtype.numpy, sh.shard_shape(box))
                if donate:
                    self._donate(array)

        self.dispatcher.submit(groups_of(arrays), run)
        return results

    def fetch(self, array: Array) -> Awaitable[np.ndarray]:
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
            pieces = [(box, self.fleet.channel(b.device.worker).fetch(b.id, b.nbytes))
                      for box, b in wanted.items()]
            self._spawn(_assemble_host(array, pieces, result))

        self.dispatcher.submit(array.groups, run)
        return result

    def ready(self, arrays: Sequence[Array]) -> Awaitable[None]:
        """Resolves when every array is computed; fails with the first error."""
        result: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def run() -> None:
            error = first_error(arrays)
            if error is not None:
                result.set_exception(error)
                return
            by_worker: dict[WorkerId, list[BufferId]] = {}
            for array in arrays:
                for buffer in array.shards:
                    by_worker.setdefault(buffer.device.worker, []).append(buffer.id)
            waits = [self.fleet.channel(w).ready(ids) for w, ids in by_worker.items()]
            self._spawn(_settle(asyncio.gather(*waits), result))

        self.dispatcher.submit(groups_of(arrays), run)
        return result

    # ---- freeing -------------------------------------------------------------------------

    def delete(self, arrays: Sequence[Array]) -> Awaitable[None]:
        """Deletes arrays now: their buffers are freed even where other arrays share them."""
        result: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for array in arrays:
            array.deleted = True

        def run() -> None:
            for array in arrays:
                array.consume()
            self.controller.free_groups([a.group for a in arrays if a.group is not None])
            self.controller.free_buffers([b for a in arrays if a.group is None
                                          for b in a.shards])
            result.set_result(None)

        self.dispatcher.submit([], run)
        return result

    def release(self, arrays: Sequence[Array]) -> None:
        """The client dropped these arrays; buffers no other array holds are freed."""
        groups: list[BufferGroup] = []
        buffers: list[Buffer] = []
        for array in arrays:
            if array.released:
                continue
            array.released = True
            self._arrays.discard(array)
            group = array.group
            if group is not None:
                group.refs -= 1
                if group.refs <= 0:
                    if group.shard_refs:
                        buffers.extend(Buffer(group, p) for p in range(len(group))
                                       if not group.held(p))
                    else:
                        groups.append(group)
                continue
            for buffer in array.shards:
                shard_refs = buffer.group.shard_refs
                assert shard_refs is not None
                shard_refs[buffer.position] -= 1
                if not buffer.group.held(buffer.position):
                    buffers.append(buffer)
        if groups or buffers:
            def free() -> None:
                self.controller.free_groups(groups)
                self.controller.free_buffers(buffers)

            self.dispatcher.submit([], free)

    # ---- programs ------------------------------------------------------------------------

    def compile(self, request: CompileRequest) -> Executable:
        devices = self.fleet.devices_of(request.device_ids)
        if len(set(d.id for d in devices)) != len(devices):
            raise errors.InvalidRequest(
                "the program's device assignment names a device twice; give each device once.")
        executable = self.controller.executable(request, devices)
        self._executables.append(executable)
        return executable

    def release_executable(self, executable: Executable) -> None:
        if executable in self._executables:
            self._executables.remove(executable)
            self.controller.release_executable(executable)

    def execute(self, executable: Executable, args: Sequence[Array],
                non_donatable: frozenset[int] = frozenset()) -> tuple[list[Array], Callable[
                    [], Awaitable[None]]]:
        """Runs a compiled program; returns its outputs and a way to wait for completion."""
        info = executable.info
        if info is None:
            raise errors.InvalidRequest(
                "the executable has not finished compiling; wait for its ready future first.")
        if len(args) != len(info.params):
            raise errors.InvalidRequest(
                f"the program takes {len(info.params)} arguments but {len(args)} were given.")
        refs: list[int | tuple[BufferId, ...]] = []
        for index, (array, aval) in enumerate(zip(args, info.params)):
            if array.dtype != aval.dtype or array.shape != aval.shape:
                raise errors.InvalidRequest(
                    f"argument {index} is {array.dtype.kind}{list(array.shape)} but the program "
                    f"expects {aval.dtype.kind}{list(aval.shape)}.")
            refs.append(self._argument(executable, index, array))
        outputs = self._outputs(executable)
        donated = frozenset(info.donated_inputs) - non_donatable
        copy_first = frozenset(info.donated_inputs) & non_donatable
        dependencies: list[BufferGroup | asyncio.Future] = list(groups_of(args))
        results = tuple(out.group.base for out in outputs)  # type: ignore[union-attr]

        def run() -> None:
            error = first_error(args) or self.fleet.unavailable(executable.devices)
            if error is not None:
                for out in outputs:
                    out.group.error = error  # type: ignore[union-attr]
                return
            self.controller.ensure_loaded(executable)
            self.fleet.multicast(executable.workers, "execute", executable.id, tuple(refs),
                                 results, copy_first)
            for index in donated:
                args[index].consume()

        self.dispatcher.submit(dependencies, run)

        async def status() -> None:
            await self.dispatcher.flush()
            by_worker: dict[WorkerId, list[BufferId]] = {}
            for out in outputs:
                group = out.group
                assert group is not None
                error = group.first_error()
                if error is not None:
                    raise error
                if group.freed or group.deleted:
                    continue
                for worker, part in executable.parts.items():
                    by_worker.setdefault(worker, []).extend(
                        BufferId(group.base + p) for p in part
                        if not (group.freed_position(p) or group.deleted_position(p)))
            await asyncio.gather(*(self.fleet.channel(w).ready(ids)
                                   for w, ids in by_worker.items() if ids))

        return outputs, status

    def _argument(self, executable: Executable, index: int, array: Array
                  ) -> int | tuple[BufferId, ...]:
        """How workers find an argument's shards: its group base when the array is a whole
        group on the program's devices in their order, else one buffer id per position."""
        devices = array.sharding.devices
        if array.group is not None and (devices is executable.device_ids
                                        or tuple(devices) == executable.device_ids):
            return array.group.base
        positions = executable.positions
        slots: list[BufferId | None] = [None] * len(executable.devices)
        for buffer in array.shards:
            p = positions.get(buffer.device.id)
            if p is not None and slots[p] is None:
                slots[p] = buffer.id
        if any(s is None for s in slots):
            raise errors.InvalidRequest(
                f"argument {index} lives on devices {list(devices)} but the program runs on "
                f"{list(executable.device_ids)}; put the argument on the program's devices "
                "first.")
        return tuple(slots)  # type: ignore[arg-type]

    def _outputs(self, executable: Executable) -> list[Array]:
        """New arrays for a program's outputs: one group each, over the program's devices."""
        info = executable.info
        assert info is not None
        if executable.output_specs is None:
            device_ids = executable.device_ids
            specs = []
            for index, aval in enumerate(info.outputs):
                memory_kind = (info.output_memory_kinds[index]
                               if index < len(info.output_memory_kinds) else None)
                if info.output_shardings is None or len(device_ids) == 1:
                    sharding = sh.Sharding(sh.ShardingKind.HLO, device_ids, memory_kind)
                else:
                    sharding = sh.Sharding(sh.ShardingKind.HLO, device_ids, memory_kind,
                                           info.output_shardings[index])
                nbytes = sh.shard_nbytes(sharding, aval.shape, aval.dtype.itemsize)
                specs.append((aval, sharding, nbytes))
            executable.output_specs = specs
        return [self._own(aval.dtype, aval.shape, sharding,
                          self.controller.new_group(executable.devices, nbytes,
                                                    sharding.memory_kind, executable.workers))
                for aval, sharding, nbytes in executable.output_specs]

    # ---- lifecycle -----------------------------------------------------------------------

    def _spawn(self, coroutine: Awaitable[object]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Frees everything the session still holds."""
        if self.closed:
            return
        self.closed = True
        self.release(list(self._arrays))
        for executable in list(self._executables):
            self.release_executable(executable)
        try:
            await asyncio.wait_for(self.dispatcher.flush(), 60)
        except asyncio.TimeoutError:
            logger.warning("a closing session's queue did not drain within 60 s")
        for task in list(self._tasks):
            task.cancel()
        self.controller.sessions.discard(self)


def _pieces(sources: Sequence[tuple[Buffer, sh.Box]], dst_box: sh.Box
            ) -> list[tuple[Buffer, tuple[slice, ...], tuple[slice, ...], int]]:
    """The distinct regions of `dst_box` that the sources hold: (source, slices into the
    source, slices into the destination, elements), one source per region."""
    pieces = []
    seen: set[sh.Box] = set()
    for buffer, box in sources:
        lo = tuple(max(s0, d0) for (s0, _), (d0, _) in zip(box, dst_box))
        hi = tuple(min(s1, d1) for (_, s1), (_, d1) in zip(box, dst_box))
        region = tuple(zip(lo, hi))
        if (dst_box and any(a >= b for a, b in zip(lo, hi))) or region in seen:
            continue
        seen.add(region)
        pieces.append((buffer,
                       tuple(slice(a - s0, b - s0) for a, b, (s0, _) in zip(lo, hi, box)),
                       tuple(slice(a - d0, b - d0) for a, b, (d0, _) in zip(lo, hi, dst_box)),
                       math.prod(b - a for a, b in region)))
    return pieces


async def _assemble_host(array: Array, pieces: list[tuple[sh.Box, Awaitable[np.ndarray]]],
                         result: asyncio.Future[np.ndarray]) -> None:
    try:
        values = await asyncio.gather(*(p for _, p in pieces))
        if len(values) == 1 and pieces[0][0] == tuple((0, d) for d in array.shape):
            host = values[0]
        else:
            dtype = object if array.dtype.is_string else array.dtype.numpy
            host = np.empty(array.shape, dtype=dtype)
            for (box, _), value in zip(pieces, values):
                host[sh.box_slices(box)] = value
        if not result.done():
            result.set_result(host)
    except Exception as e:  # noqa: BLE001
        if not result.done():
            result.set_exception(_as_error(e, "fetching the array"))


async def _settle(work: Awaitable[object], result: asyncio.Future[None]) -> None:
    try:
        await work
        if not result.done():
            result.set_result(None)
    except Exception as e:  # noqa: BLE001
        if not result.done():
            result.set_exception(_as_error(e, "waiting for the array"))


def _as_error(e: BaseException, doing: str) -> errors.IsthmusError:
    if isinstance(e, errors.IsthmusError):
        return e
    return errors.InternalError(
        f"{doing} failed unexpectedly ({type(e).__name__}: {e}); this is a bug in isthmus: "
        "please report it.")
