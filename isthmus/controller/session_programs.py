"""Programs: compiling them for a session and running them, with each argument mapped onto
the program's devices and a new array (one buffer group) made for each output.

`SessionPrograms` is the part of a `Session` (session.py) that holds the session's
executables table: the other parts that make executables add theirs to it (`keep`), and it
releases them all when the session closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence

from isthmus import dtypes, errors
from isthmus.controller import readahead
from isthmus.controller import sharding as sh
from isthmus.controller.arrays import Array, first_error, groups_of
from isthmus.controller.executables import Executable
from isthmus.controller.groups import GONE, BufferGroup
from isthmus.controller.session_core import Owner, SessionCore
from isthmus.ids import BufferId, WorkerId
from isthmus.transport import commands as c
from isthmus.transport.records import CompileRequest


class SessionPrograms:
    """Compiling and executing a session's programs (a part of `Session`, which makes their
    outputs through its arrays, an `Owner`)."""

    def __init__(self, core: SessionCore, arrays: Owner) -> None:
        self.core = core
        self.controller = core.controller
        self.fleet = core.fleet
        self.dispatcher = core.dispatcher
        self.arrays = arrays
        self._executables: list[Executable] = []

    def keep(self, executable: Executable) -> None:
        """The session holds `executable` (it is released when the session closes)."""
        self._executables.append(executable)

    def close(self) -> None:
        """The session ends: it releases every executable it still holds."""
        for executable in list(self._executables):
            self.release(executable)

    # ---- programs ------------------------------------------------------------------------

    def compile(self, request: CompileRequest) -> Executable:
        devices = self.fleet.devices_of(request.device_ids)
        if len(set(d.id for d in devices)) != len(devices):
            raise errors.InvalidRequest(
                "the program's device assignment names a device twice; give each device once.")
        companions = sum(d.companion_of is not None for d in devices)
        if 0 < companions < len(devices):
            raise errors.InvalidRequest(
                "the program spans accelerators and colocated CPU devices; run it on one "
                "kind of device (jax.device_put the arrays across first).")
        if self.core.namespace:
            request = dataclasses.replace(request, namespace=self.core.namespace)
        executable = self.controller.executable(request, devices)
        self._executables.append(executable)
        return executable

    def release(self, executable: Executable) -> None:
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
        specs = executable.param_specs
        if specs is None:
            raise errors.InternalError(
                f"executable {executable.id} has no parameter specs; this is a bug in isthmus: "
                "please report it with the server log.")
        placed, device_ids = executable.placed, executable.device_ids
        for index, (array, aval) in enumerate(zip(args, info.params)):
            if not ((array.dtype is aval.dtype and array.shape == aval.shape)
                    or dtypes.passes_as(array.dtype, array.shape, aval.dtype, aval.shape)):
                raise errors.InvalidRequest(
                    f"argument {index} is {array.dtype.kind}{list(array.shape)} but the program "
                    f"expects {aval.dtype.kind}{list(aval.shape)}.")
            if placed.get(index) is not array.sharding:  # else checked already
                _check_placement(executable, index, array, *specs[index])
            group, devices = array.group, array.sharding.devices
            if group is not None and devices is device_ids:  # the common case, inline
                refs.append(group.base)
            else:
                refs.append(self._argument(executable, index, array))
        donated = frozenset(info.donated_inputs) - non_donatable
        copy_first = frozenset(info.donated_inputs) & non_donatable
        if donated and len(args) > 1:
            _check_donations(donated, refs, len(executable.devices))
        outputs = self._outputs(executable)
        dependencies: list[BufferGroup | asyncio.Future] = list(groups_of(args))
        results = tuple(out.group.base for out in outputs)  # type: ignore[union-attr]
        ledger = self.controller.ledger

        def run() -> None:
            error = first_error(args) or self.fleet.unavailable(executable.devices)
            if error is not None:
                for out in outputs:
                    out.group.fail(None, error)  # type: ignore[union-attr]
                for index in donated:  # donated is gone, whether the program ran or not
                    if args[index].problem() is None:
                        ledger.consume(args[index])
                return
            self.controller.ensure_loaded(executable)
            self.fleet.multicast(executable.workers,
                                 c.Execute(executable.id, c.refs(refs), results, copy_first))
            if executable.readahead:  # small results clients read after earlier runs
                readahead.read_ahead(executable, outputs, self.fleet)
            if len(donated) == 1:  # a donating loop's one carry
                for index in donated:
                    ledger.consume(args[index])
            elif donated:
                ledger.consume_all([args[index] for index in donated])
            executable.runs += 1
            if self.controller.counts.timing:  # the first wait on an output times it
                stamp = [time.perf_counter()]
                for out in outputs:
                    out.group.aside().dispatched = stamp  # type: ignore[union-attr]

        ran = self.dispatcher.submit(dependencies, run, track=True)

        async def status() -> None:
            if ran is not None:  # this execution's own place in the order, nothing later
                await asyncio.shield(ran)
            by_worker: dict[WorkerId, list[BufferId]] = {}
            for out in outputs:
                group = out.group
                assert group is not None
                error = group.first_reason()
                if error is not None:
                    raise error
                if group.all_in(*GONE):
                    continue
                for worker, part in executable.parts.items():
                    by_worker.setdefault(worker, []).extend(
                        BufferId(group.base + p) for p in part
                        if group.state_at(p) not in GONE)
            await asyncio.gather(*(self.fleet.channel(w).ask(c.Ready(tuple(ids)))
                                   for w, ids in by_worker.items() if ids))
            if self.controller.counts.timing:
                self.controller.counts.waited(out.group for out in outputs)

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
        if executable.output_specs is None:
            raise errors.InternalError(
                f"executable {executable.id} has no output specs; this is a bug in isthmus: "
                "please report it with the server log.")
        specs = executable.output_specs
        if len(specs) == 1:  # one output: making a batch costs more than it saves
            (aval, sharding, nbytes, origin), = specs
            group = self.controller.ledger.new_group(executable.devices, nbytes,
                                                     sharding.memory_kind, executable.workers)
            group.origin = origin
            return [self.arrays.own(aval.dtype, aval.shape, sharding, group)]
        groups = self.controller.ledger.new_groups(
            executable.devices, [(spec.nbytes, spec.sharding.memory_kind) for spec in specs],
            executable.workers)
        made = []
        for (aval, sharding, _, origin), group in zip(specs, groups):
            group.origin = origin
            made.append((aval.dtype, aval.shape, sharding, group))
        return self.arrays.own_all(made)


def _check_placement(executable: Executable, index: int, array: Array,
                     expected: sh.Sharding | None, memory_kind: str) -> None:
    """Refuses an argument whose shards are not where and what the program reads: jaxlib
    trusts the shards it is given (a wrong shape crashes the process, a permuted order
    computes a wrong answer)."""
    if executable.placed.get(index) is array.sharding:
        return  # checked already (shardings are immutable)
    if expected is not None:
        problem = sh.placement_mismatch(array.sharding, expected, array.shape)
        if problem is not None:
            raise errors.InvalidRequest(
                f"argument {index} {problem}; the program was compiled for another sharding "
                "of it. Reshard the argument to the program's input sharding (jax.device_put "
                "with the jitted function's input shardings) or compile for this one.")
    kind = array.sharding.memory_kind or executable.devices[0].memory_kinds[0]
    if kind != memory_kind:
        raise errors.InvalidRequest(
            f"argument {index} is in memory kind {kind!r} but the program reads it from "
            f"{memory_kind!r}; copy it there first (jax.device_put with a sharding of that "
            "memory kind).")
    executable.placed[index] = array.sharding


def _check_donations(donated: frozenset[int], refs: Sequence[int | tuple[BufferId, ...]],
                     count: int) -> None:
    """Refuses a donated argument whose buffers another argument also reads (jaxlib would
    free them under the other read). O(arguments) when every argument is a whole group (a
    training step's), O(shards) otherwise."""
    if all(isinstance(ref, int) for ref in refs):
        # Groups own disjoint id ranges: two arguments share buffers iff they share a base.
        if len(set(refs)) == len(refs):
            return
        pairs = [(i, j) for i, a in enumerate(refs) for j, b in enumerate(refs)
                 if i != j and a == b]
    else:
        owner: dict[int, int] = {}
        pairs = []
        for i, ref in enumerate(refs):
            for buffer in (range(ref, ref + count) if isinstance(ref, int) else set(ref)):
                j = owner.setdefault(buffer, i)
                if j != i:
                    pairs.append((j, i))
    for i, j in pairs:
        index, other = (i, j) if i in donated else (j, i)
        if index in donated:
            raise errors.InvalidRequest(
                f"argument {index} is donated to the program, but argument {other} reads "
                "the same buffers; pass a copy as one of them, or do not donate it.")
