"""The fuzzer's episodes: a few requests each, well-formed or mutated, over the arrays and
executables a session holds. The mutations are in
`fuzz_mutations.py`, which also holds the table of all episodes (`EPISODES`).

Every array derived from another (disassembled, assembled, copied, resharded, bitcast,
remapped, a replicated shard) joins its family whatever the copy semantics: jaxlib's own
IFRT arrays share buffers even under ALWAYS_COPY, so deleting one may end the others.

An episode sends its requests (pipelined: it does not wait between them unless it must),
says what each must give (`expect="ok"` for a well-formed request; reads are checked
against the model), and updates the model in the callbacks, which run in send order once
the answers are in. A mutated request may be refused or may work; when it works its results
must be right (they enter the model as MAYBE: their value or a clean error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tests.integration.fuzz_programs import PROGRAMS
from tests.integration.fuzzer import (
    ALWAYS_COPY,
    DONATE_INPUT,
    F32,
    REUSE_INPUT,
    S32,
    Arr,
    Sess,
    State,
    shard_values,
)
from tests.integration.rawclient import array_spec

SEMANTICS = (ALWAYS_COPY, REUSE_INPUT, DONATE_INPUT)
MEMORIES = ("pinned_host", "unpinned_host")


def random_layout(s: Sess) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """A random (layout, devices, shape) the session's devices allow."""
    rng, n_all = s.f.rng, len(s.devices)
    layout = rng.choice(("single", "tiled", "tiled", "replicated") +
                        (("grid",) if n_all >= 4 else ()))
    if layout == "single":
        n = 1
    elif layout == "grid":
        n = 4
    else:
        n = rng.choice([k for k in (1, 2, 4) if k <= n_all])
    devices = tuple(rng.sample(s.devices, n))
    shape = (4, 4) if layout == "grid" else rng.choice(((8,), (8,), (8, 3)))
    return layout, devices, shape


def _later(s: Sess, fn: Callable[[], None]) -> None:
    s.after.append(fn)


# ---- well-formed ------------------------------------------------------------------------

def make_read(s: Sess) -> None:
    """Upload in every form the stock client uses, sometimes after the request; read back."""
    rng = s.f.rng
    layout, devices, shape = random_layout(s)
    form = rng.choice(("whole", "shards") + (("strided",) if len(shape) == 2 else ()))
    late = rng.random() < 0.3
    arr, upload = s.make(s.value(shape), devices, layout, form=form, late=late)
    if late and rng.random() < 0.5:
        s.ready(arr)
    if late:
        upload()
    s.read(arr, strides=rng.random() < 0.3)


def execute_ok(s: Sess) -> None:
    rng = s.f.rng
    exe = s.exe()
    if exe is None:
        return
    args = s.args_for(exe)
    minted = rng.random() < 0.2
    out = s.execute(exe, args, server_minted=minted)
    if minted:
        s.settle()
        if out.handle and out.state != State.GONE:
            s.read(out)
    elif rng.random() < 0.7:
        s.read(out)
    if rng.random() < 0.3 and exe.program.donate:
        for i in exe.program.donate:  # a donated argument is gone
            s.read(args[i])


def chain(s: Sess) -> None:
    """A 1-device program applied to its own output a few times, pipelined, then read."""
    exe = s.exe(lambda e: e.program.name in ("add1", "add1_donate"))
    if exe is None:
        return
    x = s.ensure(exe.devices, "single", (8,))
    for _ in range(s.f.rng.randint(2, 5)):
        x = s.execute(exe, [x])
    s.read(x)


def disassemble(s: Sess) -> None:
    rng = s.f.rng
    arr = s.pick(lambda a: not a.big)
    if arr is None:
        return make_read(s)
    semantics = rng.choice(SEMANTICS)
    parts = [Arr(s.new(), v, (d,), "single", State.OK,
                 arr.family, arr.memory)
             for v, d in zip(shard_values(arr), arr.devices)]
    body = s.msg("DisassembleIntoSingleDeviceArraysRequest", array_handle=arr.handle,
                 copy_semantics=semantics, single_device_shard_semantics=rng.choice((1, 2)),
                 result_handles=[p.handle for p in parts])
    before = arr.state

    def then(response: Any, ok: bool) -> None:
        for p in parts:
            p.state = max(before, arr.state) if ok else State.GONE
        if ok and semantics == DONATE_INPUT:
            s.end(arr)
            for p in parts:
                p.state = before
        for p in parts:
            s.add(p)

    s.request("disassemble_into_single_device_arrays_request", body, needs=[arr], then=then)
    for p in rng.sample(parts, min(len(parts), 2)):
        s.read(p)
    if semantics == DONATE_INPUT and rng.random() < 0.3:
        s.read(arr)


def assemble(s: Sess) -> None:
    """Single-device arrays assembled into a tiled, grid or replicated array."""
    rng = s.f.rng
    layout, devices, shape = random_layout(s)
    if layout == "single":
        layout, shape = "tiled", (8,)
    whole = s.value(shape)
    probe = Arr(0, whole, devices, layout, State.OK, 0)
    parts = [s.make(np.ascontiguousarray(v), (d,), "single")[0]
             for v, d in zip(shard_values(probe), devices)]
    semantics = rng.choice(SEMANTICS)
    out = Arr(s.new(), whole, devices, layout, State.OK,
              parts[0].family)
    body = s.msg("AssembleArrayFromSingleDeviceArraysRequest",
                 single_device_array_handles=[p.handle for p in parts], copy_semantics=semantics,
                 single_device_shard_semantics=rng.choice((1, 2)), result_handle=out.handle)
    body.shape.dims.extend(shape)
    body.sharding.CopyFrom(s.sharding(layout, devices, rank=len(shape)))
    if rng.random() < 0.5:
        body.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32

    def then(response: Any, ok: bool) -> None:
        out.state = State.OK if ok else State.GONE
        if ok:
            for p in parts:
                p.family = out.family
                if semantics == DONATE_INPUT:
                    p.state = State.GONE
        s.add(out)

    s.request("assemble_array_from_single_device_arrays_request", body, needs=parts,
              then=then)
    s.read(out)


def copy_arrays(s: Sess) -> None:
    rng = s.f.rng
    arr = s.pick(lambda a: not a.big)
    if arr is None:
        return make_read(s)
    group = [arr] + [a for a in s.live(lambda a: a.devices == arr.devices and a is not arr
                                       and not a.big)][:rng.randint(0, 1)]
    target = tuple(rng.sample(s.devices, len(arr.devices)))
    memory = rng.choice(("", "", "device", "pinned_host"))
    semantics = rng.choice(SEMANTICS)
    body = s.msg("CopyArraysRequest", array_handles=[a.handle for a in group],
                 device_ids=list(target), copy_semantics=semantics)
    if memory:
        body.memory_kind = memory
    outs = [Arr(s.new(), a.value, target, a.layout, State.OK, a.family,
                a.memory if not memory else memory if memory != "device" else "")
            for a in group]
    body.result_handles.extend(o.handle for o in outs)
    states = [a.state for a in group]

    def then(response: Any, ok: bool) -> None:
        for o, a, before in zip(outs, group, states):
            o.state = before if ok else State.GONE
            s.add(o)
            if ok and semantics == DONATE_INPUT:
                s.end(a)
                o.state = before

    s.request("copy_arrays_request", body, needs=group, then=then)
    for o in outs:
        s.read(o)


def reshard(s: Sess) -> None:
    rng = s.f.rng
    arr = s.pick(lambda a: not a.big and a.value.shape[0] % 4 == 0)
    if arr is None:
        return make_read(s)
    layout = rng.choice(("single", "tiled", "replicated"))
    n = 1 if layout == "single" else rng.choice([k for k in (1, 2, 4) if k <= len(s.devices)])
    devices = tuple(rng.sample(s.devices, n))
    kind = F32 if arr.value.dtype == np.float32 else S32
    semantics = rng.choice(SEMANTICS)
    out = Arr(s.new(), arr.value, devices, layout, State.OK,
              arr.family)
    body = s.msg("ReshardArraysRequest", array_handles=[arr.handle], result_handles=[out.handle],
                 copy_semantics=semantics)
    body.array_specs.append(array_spec(s.s, kind, list(arr.value.shape),
                                       s.sharding(layout, devices, rank=arr.value.ndim)))
    then = _derived(s, arr, out, semantics)

    s.request("reshard_arrays_request", body, needs=[arr], then=then)
    s.read(out)


def bitcast(s: Sess) -> None:
    rng = s.f.rng
    arr = s.pick(lambda a: not a.big)
    if arr is None:
        return make_read(s)
    to_int = arr.value.dtype == np.float32
    value = arr.value.view(np.int32 if to_int else np.float32)
    semantics = rng.choice(SEMANTICS)
    out = Arr(s.new(), value, arr.devices, arr.layout, State.OK,
              arr.family, arr.memory)
    body = s.msg("BitcastArraysRequest", array_handles=[arr.handle], result_handles=[out.handle],
                 copy_semantics=semantics)
    body.array_specs.append(array_spec(s.s, S32 if to_int else F32, list(value.shape),
                                       s.sharding(arr.layout, arr.devices, arr.memory,
                                                  arr.value.ndim)))
    then = _derived(s, arr, out, semantics)

    s.request("bitcast_arrays_request", body, needs=[arr], then=then)
    s.read(out)


def remap_inputs(s: Sess) -> tuple[Arr, Arr] | None:
    if len(s.devices) < 4:
        return None
    devices = s.f.rng.sample(s.devices, 4)
    a = s.ensure(devices[:2], "tiled", (8,))
    b = s.ensure(devices[2:], "tiled", (8,))
    return a, b


def remap_plan(s: Sess, a: Arr, b: Arr) -> Any:
    """Both shards of `a` then both of `b`, into one array tiled over the four devices."""
    plan = s.s["xla.ifrt.RemapPlanProto"]()
    for x in (a, b):
        plan.input_specs.append(array_spec(s.s, F32, [8], s.sharding("tiled", x.devices)))
    plan.output_specs.append(array_spec(s.s, F32, [16],
                                        s.sharding("tiled", a.devices + b.devices)))
    plan.mappings.add(in_array=0, out_array=0, from_start=[0], from_end=[2], from_step=[1],
                      to_start=[0], to_end=[2], to_step=[1])
    plan.mappings.add(in_array=1, out_array=0, from_start=[0], from_end=[2], from_step=[1],
                      to_start=[2], to_end=[4], to_step=[1])
    return plan


def remap(s: Sess) -> None:
    pair = remap_inputs(s)
    if pair is None:
        return make_read(s)
    a, b = pair
    semantics = s.f.rng.choice((REUSE_INPUT, DONATE_INPUT))
    out = Arr(s.new(), np.concatenate([a.value, b.value]), a.devices + b.devices, "tiled",
              State.OK, a.family)
    body = s.msg("RemapArraysRequest", array_handles=[a.handle, b.handle],
                 result_handles=[out.handle], copy_semantics=semantics)
    body.plan.CopyFrom(remap_plan(s, a, b))
    before = max(a.state, b.state)

    def then(response: Any, ok: bool) -> None:
        out.state = before if ok else State.GONE
        if ok:
            b.family = a.family
            if semantics == DONATE_INPUT:
                s.end(a)
                s.end(b)
                out.state = before
        s.add(out)

    s.request("remap_arrays_request", body, needs=[a, b], then=then)
    s.read(out)


def replicated_shard(s: Sess) -> None:
    rng = s.f.rng
    arr = s.pick(lambda a: a.layout in ("replicated", "single") and not a.big)
    if arr is None:
        arr = s.make(s.value((8,)), tuple(rng.sample(s.devices, min(2, len(s.devices)))),
                     "replicated")[0]
    semantics = rng.choice(SEMANTICS)
    out = Arr(s.new(), arr.value, arr.devices[:1], "single", State.OK,
              arr.family, arr.memory)
    body = s.msg("FullyReplicatedShardRequest", array_handle=arr.handle,
                 copy_semantics=semantics, result_handle=out.handle)
    then = _derived(s, arr, out, semantics)

    s.request("fully_replicated_shard_request", body, needs=[arr], then=then)
    s.read(out)


def delete_destruct(s: Sess) -> None:
    """DeleteArray (then its future, IsArrayDeleted, a read that must fail) or
    DestructArray."""
    rng = s.f.rng
    arr = s.pick()
    if arr is None:
        return make_read(s)
    if rng.random() < 0.7:
        def then(response: Any, ok: bool) -> None:
            if ok:
                s.end(arr)
                future = response.delete_array_response.deletion_future_handle
                _later(s, lambda: _check_future(s, future))

        s.request("delete_array_request",
                  s.msg("DeleteArrayRequest", array_handle=[arr.handle]), expect="any",
                  then=then)
        s.request("is_array_deleted_request",
                  s.msg("IsArrayDeletedRequest", array_handle=arr.handle), expect="any")
        s.read(arr)
    else:
        s.arrays.pop(arr.handle)
        s.request("destruct_array_request", s.msg("DestructArrayRequest",
                                                  array_handle=[arr.handle]))
        s.dead.append(arr.handle)
        s.request("check_value_ready_request",
                  s.msg("CheckValueReadyRequest", value_handles=[arr.handle]), expect="any")


def _check_future(s: Sess, future: int) -> None:
    s.request("check_future_request", s.msg("CheckFutureRequest", future_handle=future))
    s.settle()


def ready_many(s: Sess) -> None:
    arrays = s.live()
    if arrays:
        s.ready(*s.f.rng.sample(arrays, min(len(arrays), 4)))


def compile_ok(s: Sess) -> None:
    program = s.f.rng.choice([p for p in PROGRAMS if p.devices <= len(s.devices)])
    s.compile(program, s.program_devices(program))


def executable_queries(s: Sess) -> None:
    exe = s.exe()
    if exe is None:
        return
    for kind in ("loaded_executable_metadata_request",
                 "loaded_executable_cost_analysis_request",
                 "loaded_executable_human_readable_program_text_request",
                 "loaded_executable_is_deleted_request"):
        name = "".join(w.capitalize() for w in kind.split("_"))
        body = s.msg(name, loaded_executable_handle=exe.handle)
        s.request(kind, body, expect="ok" if kind.endswith("metadata_request") else "any")
    layout = s.msg("GetDefaultLayoutRequest", dims=[8], device_id=s.f.rng.choice(s.devices))
    layout.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
    s.request("get_default_layout_request", layout)
    n = s.f.rng.randint(1, len(s.devices))
    s.request("get_default_device_assignment_request", s.msg(
        "GetDefaultDeviceAssignmentRequest", num_replicas=1, num_partitions=n))


def error_arrays(s: Sess) -> None:
    """MakeErrorArrays: the arrays carry the client's error; using them fails with it."""
    arrays = []
    body = s.msg("MakeErrorArraysRequest")
    body.error.code = 9
    body.error.message = "an error the fuzzer made"
    for _ in range(s.f.rng.randint(1, 2)):
        layout, devices, shape = random_layout(s)
        arr = Arr(s.new(), np.zeros(shape, np.float32), devices, layout, State.GONE, s.family())
        body.array_specs.append(array_spec(s.s, F32, list(shape),
                                           s.sharding(layout, devices, rank=len(shape))))
        body.array_handles.append(arr.handle)
        arrays.append(arr)
        s.add(arr)
    s.request("make_error_arrays_request", body)
    s.read(arrays[0])


def _derived(s: Sess, arr: Arr, out: Arr, semantics: int) -> Callable[[Any, bool], None]:
    """The `then` of a request that makes `out` from `arr`: `out` is as good as `arr` was
    if the request succeeded (gone if not), and a DONATE_INPUT request ends `arr`."""
    before = arr.state

    def then(response: Any, ok: bool) -> None:
        out.state = before if ok else State.GONE
        s.add(out)
        if ok and semantics == DONATE_INPUT:
            s.end(arr)
            out.state = before

    return then
