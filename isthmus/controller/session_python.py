"""Colocated Python programs of a session: compiling (their hosts unpickle them) and calling.

A call runs on every worker that holds one of its devices (`worker/colocated.py`). Its
outputs are new arrays, one buffer group each over the devices of its output spec, which stay
*pending* until every worker has finished its part: operations that read them wait in the
session's dispatch queue, as they wait for host data. A failed call (the function raised, a
worker was lost) leaves its error in the outputs. `SessionPython` is the part of a `Session`
(session.py) that compiles and calls them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence

from isthmus import dtypes, errors
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, BufferGroup, first_error, groups_of
from isthmus.controller.executables import Executable, InputSpec, OutputSpec
from isthmus.controller.session_core import Keeper, Owner, SessionCore, as_error
from isthmus.ids import BufferId
from isthmus.transport import commands as c
from isthmus.transport.records import Aval, ColocatedProgram, CompiledInfo

Spec = tuple[dtypes.DType, tuple[int, ...], sh.Sharding]  # dtype, shape, sharding


class SessionPython:
    """Colocated Python functions of one session (a part of `Session`, which makes their
    outputs through its arrays, an `Owner`, and holds their executables, a `Keeper`)."""

    def __init__(self, core: SessionCore, arrays: Owner, programs: Keeper) -> None:
        self.core = core
        self.controller = core.controller
        self.fleet = core.fleet
        self.dispatcher = core.dispatcher
        self.arrays = arrays
        self.programs = programs

    def compile(self, name: str, text: bytes, device_ids: Sequence[int],
                       inputs: Sequence[Spec], outputs: Sequence[Spec]) -> Executable:
        if self.core.python_refusal is not None:
            raise errors.NotPermitted(f"colocated Python {name!r} refused: "
                                      f"{self.core.python_refusal}.")
        devices = self.fleet.devices_of(device_ids)
        if len(set(device_ids)) != len(device_ids):
            raise errors.InvalidRequest("the colocated function names a device twice.")
        call_devices = set(device_ids)
        for kind, specs in (("input", inputs), ("output", outputs)):
            for index, (_, _, sharding) in enumerate(specs):
                if not set(sharding.devices) <= call_devices:
                    raise errors.InvalidRequest(
                        f"{kind} {index} of the colocated function lives on devices "
                        f"{list(sharding.devices)}, not all of which are the call's devices "
                        f"{list(device_ids)}; use the same devices for inputs, outputs and "
                        "the call.")
        for device in devices:
            if device.kind != "cpu":
                raise errors.InvalidRequest(
                    f"device {device.id} ({device.kind}) is not a CPU device; colocated "
                    "Python runs on CPU devices: pass colocated_python.colocated_cpu_devices"
                    "(...) instead.")
        program = ColocatedProgram(
            name, text, tuple(device_ids),
            tuple(tuple(s.devices) for _, _, s in inputs),
            tuple(tuple(s.devices) for _, _, s in outputs),
            tuple((dtype_name(d), tuple(shape)) for d, shape, _ in outputs))
        info = CompiledInfo(
            name=name, params=tuple(Aval(d, tuple(shape)) for d, shape, _ in inputs),
            outputs=tuple(Aval(d, tuple(shape)) for d, shape, _ in outputs),
            param_shardings=None, output_shardings=None,
            param_layouts=tuple(default_layout(shape) for _, shape, _ in inputs),
            output_layouts=tuple(default_layout(shape) for _, shape, _ in outputs),
            output_memory_kinds=tuple(s.memory_kind or "" for _, _, s in outputs),
            donated_inputs=(), fingerprint=hashlib.sha256(text).digest(),
            memory_stats={}, generated_code_bytes=0)
        executable = self.controller.executable(program, devices, info)
        executable.output_specs = [
            OutputSpec(Aval(d, tuple(shape)), s, sh.shard_nbytes(s, tuple(shape), d.itemsize))
            for d, shape, s in outputs]
        executable.input_specs = [InputSpec(d, tuple(shape), s) for d, shape, s in inputs]
        self.programs.keep(executable)
        return executable

    def call(self, executable: Executable, args: Sequence[Array],
             stream: tuple[int, ...]) -> tuple[list[Array], Callable[[], Awaitable[None]]]:
        """Runs a colocated function; returns its outputs and a way to wait for the call."""
        specs, output_specs = executable.input_specs, executable.output_specs
        if specs is None or output_specs is None:
            raise errors.InternalError(
                f"executable {executable.id} is no colocated function; this is a bug in "
                "isthmus: please report it.")
        if len(args) != len(specs):
            raise errors.InvalidRequest(
                f"the colocated function takes {len(specs)} arrays but {len(args)} were given.")
        refs: list[int | tuple[BufferId, ...]] = []
        for index, (array, (dtype, shape, sharding)) in enumerate(zip(args, specs)):
            if array.dtype != dtype or array.shape != shape:
                raise errors.InvalidRequest(
                    f"argument {index} is {array.dtype.kind}{list(array.shape)} but the "
                    f"function expects {dtype.kind}{list(shape)}.")
            if tuple(array.sharding.devices) != tuple(sharding.devices):
                raise errors.InvalidRequest(
                    f"argument {index} lives on devices {list(array.sharding.devices)} but the "
                    f"function's input spec names {list(sharding.devices)}; pass arrays with "
                    "the sharding the function was specialized for.")
            group = array.group
            refs.append(group.base if group is not None else tuple(b.id for b in array.shards))
        outputs = []
        for aval, sharding, nbytes, _ in output_specs:
            group = self.controller.ledger.new_group(
                self.fleet.devices_of(sharding.devices), nbytes, sharding.memory_kind,
                definers=1)
            outputs.append(self.arrays.own(aval.dtype, aval.shape, sharding, group))
        results = tuple(out.group.base for out in outputs)  # type: ignore[union-attr]
        out_groups = [out.group for out in outputs]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def run() -> None:
            error = first_error(args) or self.fleet.unavailable(executable.devices)
            if error is not None:
                finish(out_groups, done, error)
                return
            try:
                self.controller.ensure_loaded(executable)
                waits = [self.fleet.channel(w).ask(
                    c.CallPython(executable.id, c.refs(refs), tuple(results), tuple(stream)))
                         for w in executable.workers]
            except Exception as e:
                finish(out_groups, done, as_error(e, "dispatching a colocated call"))
                raise
            self.core.spawn(settle_after(out_groups, done, waits, "a colocated call"))

        self.dispatcher.submit(groups_of(args), run)

        async def status() -> None:
            await asyncio.shield(done)

        return outputs, status


def dtype_name(dtype: dtypes.DType) -> str:
    """How hosts name a dtype: numpy's name, or "string"."""
    return "string" if dtype.is_string else dtype.numpy.name  # type: ignore[union-attr]


def default_layout(shape: Sequence[int]) -> str:
    """A dense row-major layout, as XLA writes it (minor to major)."""
    return "{" + ",".join(str(d) for d in reversed(range(len(shape)))) + "}"


async def settle_after(groups: Sequence[BufferGroup | None], done: asyncio.Future[None],
                       waits: Sequence[Awaitable[object]], doing: str) -> None:
    """Finishes a call's outputs (`finish`) once every host has answered."""
    outcomes = await asyncio.gather(*waits, return_exceptions=True)
    error = next((e for e in outcomes if isinstance(e, BaseException)), None)
    finish(groups, done, None if error is None else as_error(error, doing))


def finish(groups: Sequence[BufferGroup | None], done: asyncio.Future[None],
           error: errors.IsthmusError | None) -> None:
    """The outputs become defined (holding `error`, if any) and `done` resolves."""
    for group in groups:
        assert group is not None
        if error is not None:
            group.fail(None, error)
        group.settle()
    if not done.done():
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
            done.exception()  # retrieved: the status or the outputs report it
