"""The fuzzer's mutated episodes: the requests of issue 23 and their relatives. Each
builds real state first, then sends the request a well-behaved client would not; a refusal
(a clean error) is always fine, an answer must be right, and the session must go on.

`EPISODES` maps every episode label (family/case) to (weight, episode), well-formed ones
(`fuzz_cases.py`) included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tests.integration import fuzz_bytes
from tests.integration import fuzz_cases as ok
from tests.integration.fuzz_cases import MEMORIES, make_read, remap_inputs, remap_plan
from tests.integration.fuzz_programs import PROGRAMS
from tests.integration.fuzzer import (
    ALWAYS_COPY,
    DONATE_INPUT,
    F32,
    REUSE_INPUT,
    S32,
    Arr,
    Episode,
    Exe,
    Sess,
    State,
    shard_values,
)
from tests.integration.rawclient import array_spec, status_of


def _mutated_execute(s: Sess, change: Callable[[Exe, list[Arr]], list[Arr] | None],
                     pred: Callable[[Exe], bool] = lambda e: True,
                     tweak: Callable[[Any], None] | None = None) -> None:
    """Executes with arguments `change` built; a refusal is fine, an answer must be right.
    Then a fresh request on the session shows it still works."""
    exe = s.exe(pred)
    if exe is None:
        return
    args = s.args_for(exe)
    changed = change(exe, args)
    if changed is None:
        return
    out = s.execute(exe, changed, state=State.MAYBE, expect="any", tweak=tweak)
    s.read(out)
    s.settle()
    if not s.broken:
        probe = s.make(s.value((8,)), (s.f.rng.choice(s.devices),), "single")[0]
        s.read(probe)


def _swap_layout(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    """Defect 1's shape: a tiled argument given replicated or the reverse."""
    spots = [i for i, a in enumerate(exe.program.args) if a.layout in ("tiled", "replicated")]
    if not spots or len(exe.devices) == 1:
        return None
    i = s.f.rng.choice(spots)
    wrong = "replicated" if exe.program.args[i].layout == "tiled" else "tiled"
    args[i] = s.ensure(exe.devices, wrong, exe.program.args[i].shape)
    return args


def _permute(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    """Defect 3's shape: a tiled argument over the program's devices in another order."""
    spots = [i for i, a in enumerate(exe.program.args) if a.layout in ("tiled", "grid")]
    if not spots or len(set(exe.devices)) < 2:  # (a program built over one device)
        return None
    i = s.f.rng.choice(spots)
    devices = list(exe.devices)
    while tuple(devices) == exe.devices:
        s.f.rng.shuffle(devices)
    args[i] = s.ensure(devices, exe.program.args[i].layout, exe.program.args[i].shape)
    return args


def _other_devices(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    others = [d for d in s.devices if d not in exe.devices]
    i = s.f.rng.randrange(len(args))
    spec = exe.program.args[i]
    if len(others) >= len(exe.devices):
        devices = tuple(s.f.rng.sample(others, len(exe.devices)))
    elif len(exe.devices) > 1:
        devices = exe.devices[:-1]  # fewer devices
        if spec.layout == "grid":
            return None
    else:
        return None
    args[i] = s.ensure(devices, spec.layout, spec.shape)
    return args


def _memory_kind(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    """Defect 10's shape: an argument in host memory."""
    i = s.f.rng.randrange(len(args))
    spec = exe.program.args[i]
    args[i] = s.ensure(exe.devices, spec.layout, spec.shape, memory=s.f.rng.choice(MEMORIES))
    return args


def _shape_dtype(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    i = s.f.rng.randrange(len(args))
    spec = exe.program.args[i]
    layout = spec.layout if spec.layout != "grid" or len(exe.devices) == 4 else "tiled"
    if s.f.rng.random() < 0.5:
        shape = (spec.shape[0] * 2, *spec.shape[1:])
        args[i] = s.make(s.value(shape), exe.devices, layout)[0]
    else:
        value = s.value(spec.shape, np.int32)
        args[i] = s.make(value, exe.devices, layout)[0]
    return args


def _arg_count(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    if s.f.rng.random() < 0.5 or len(args) == 1:
        return args + [args[0]]
    return args[:-1]


def _bad_handle(s: Sess, exe: Exe, args: list[Arr]) -> list[Arr] | None:
    rng = s.f.rng
    i = rng.randrange(len(args))
    choice = rng.choice(("unknown", "dead", "deleted", "error", "foreign"))
    s.label += f"[{choice}]"
    a = args[i]
    if choice == "unknown":
        handle = rng.randrange(1 << 40, 1 << 50)
    elif choice == "dead" and s.dead:
        handle = rng.choice(s.dead)
    elif choice == "foreign" and len(s.f.sessions) > 1:
        others = [h for x in s.f.sessions if x is not s for h in x.arrays]
        handle = rng.choice(others) if others else rng.randrange(1 << 40, 1 << 50)
    elif choice == "error":
        body = s.msg("MakeErrorArraysRequest")
        body.error.code = 9
        body.error.message = "an error the fuzzer made"
        handle = s.new()
        body.array_specs.append(array_spec(s.s, F32, list(a.value.shape),
                                           s.sharding(a.layout, a.devices,
                                                      rank=a.value.ndim)))
        body.array_handles.append(handle)
        s.request("make_error_arrays_request", body)
    else:
        victim = s.ensure(a.devices, a.layout, a.value.shape)
        s.request("delete_array_request",
                  s.msg("DeleteArrayRequest", array_handle=[victim.handle]), expect="any",
                  then=lambda r, ok: s.end(victim) if ok else None)
        handle = victim.handle
    args[i] = Arr(handle, a.value, a.devices, a.layout, State.GONE, -1)
    return args


def exec_same_arg_donated(s: Sess) -> None:
    """One array as both arguments of a program that donates the first."""
    def change(exe: Exe, args: list[Arr]) -> list[Arr]:
        return [args[0], args[0]]
    _mutated_execute(s, change, lambda e: e.program.name == "addxy_donate")


def exec_device_ids(s: Sess) -> None:
    """Execute's device_ids (for portable executables) naming other devices."""
    rng = s.f.rng

    def tweak(body: Any) -> None:
        body.device_ids.extend(rng.sample(s.devices, rng.randint(1, len(s.devices))))

    _mutated_execute(s, lambda e, a: a, tweak=tweak)


def exec_non_donatable(s: Sess) -> None:
    rng = s.f.rng

    def tweak(body: Any) -> None:
        body.execute_options.non_donatable_input_indices.extend(
            rng.sample(range(-1, 4), rng.randint(1, 3)))

    _mutated_execute(s, lambda e, a: a, lambda e: bool(e.program.donate), tweak)


def exec_bad_executable(s: Sess) -> None:
    rng = s.f.rng
    exe = s.exe()
    if exe is None:
        return
    handle = rng.choice(s.dead) if s.dead and rng.random() < 0.5 else rng.randrange(1 << 40)
    fake = Exe(handle, exe.program, exe.devices, False)
    out = s.execute(fake, s.args_for(exe), state=State.GONE, expect="any")
    s.read(out)


def exec_ready_then_donate(s: Sess) -> None:
    """Defect 6's shape: CheckValueReady(out) and at once an execute donating `out`."""
    exe = s.exe(lambda e: e.program.name in ("add1_donate", "grid4_donate"))
    if exe is None:
        return
    args = s.args_for(exe)
    out = s.execute(exe, args)
    s.ready(out)
    again = s.execute(exe, [out])
    s.read(again)


def order_late_upload(s: Sess) -> None:
    """Defect 5's shape: while an upload is late, a use of x and then an end of x; the use
    must act first and succeed."""
    rng = s.f.rng
    exe = s.exe(lambda e: e.program.devices == 1 or rng.random() < 0.3)
    if exe is None:
        return
    args = s.args_for(exe)
    x = args[0]
    s.settle()
    if x.state != State.OK:
        return
    late, upload = s.make(s.value((8,)), (rng.choice(s.devices),), "single", late=True)
    use = rng.choice(("read", "execute", "ready", "disassemble", "shard"))
    if use == "read":
        s.read(x)
    elif use == "execute":
        out = s.execute(exe, args)
        s.read(out)
    elif use == "ready":
        s.ready(x)
    elif use == "disassemble":
        parts = [Arr(s.new(), v, (d,), "single", State.OK, x.family, x.memory)
                 for v, d in zip(shard_values(x), x.devices)]
        s.request("disassemble_into_single_device_arrays_request", s.msg(
            "DisassembleIntoSingleDeviceArraysRequest", array_handle=x.handle,
            copy_semantics=ALWAYS_COPY, result_handles=[p.handle for p in parts]),
            then=lambda r, ok: [s.add(p) for p in parts])
        s.read(parts[0])
    else:
        out = Arr(s.new(), x.value, x.devices[:1], "single", State.OK, x.family, x.memory)
        if x.layout in ("single", "replicated"):
            s.request("fully_replicated_shard_request", s.msg(
                "FullyReplicatedShardRequest", array_handle=x.handle,
                copy_semantics=ALWAYS_COPY, result_handle=out.handle),
                then=lambda r, ok: s.add(out))
            s.read(out)
    end = rng.choice(("delete", "donate_disassemble", "donate_copy", "donate_execute"))
    s.label += f"[{use}, then {end}]"
    if end == "delete":
        s.request("delete_array_request",
                  s.msg("DeleteArrayRequest", array_handle=[x.handle]),
                  then=lambda r, ok: s.end(x) if ok else None)
    elif end == "donate_disassemble":
        parts = [Arr(s.new(), v, (d,), "single", State.OK, x.family, x.memory)
                 for v, d in zip(shard_values(x), x.devices)]
        s.request("disassemble_into_single_device_arrays_request", s.msg(
            "DisassembleIntoSingleDeviceArraysRequest", array_handle=x.handle,
            copy_semantics=DONATE_INPUT, result_handles=[p.handle for p in parts]),
            then=lambda r, ok: _donated(s, x, parts, ok))
    elif end == "donate_copy":
        out = Arr(s.new(), x.value, x.devices, x.layout, State.OK, x.family, x.memory)
        s.request("copy_arrays_request", s.msg(
            "CopyArraysRequest", array_handles=[x.handle], device_ids=list(x.devices),
            copy_semantics=DONATE_INPUT, result_handles=[out.handle]),
            then=lambda r, ok: _donated(s, x, [out], ok))
    else:
        # Only an executable the session holds: compiling now would settle before the upload.
        donors = [e for e in s.exes.values()
                  if e.program.name == "add1_donate" and e.devices == x.devices]
        donor = donors[0] if donors else None
        if donor is not None and x.layout == "single" and x.value.shape == (8,) \
                and x.value.dtype == np.float32 and not x.memory:
            s.execute(donor, [x])
        else:
            s.request("delete_array_request", s.msg("DeleteArrayRequest",
                                                    array_handle=[x.handle]),
                      then=lambda r, ok: s.end(x) if ok else None)
    upload()
    s.read(late)


def _donated(s: Sess, x: Arr, results: list[Arr], ok: bool) -> None:
    """`x` was given with DONATE_INPUT: the results hold what it held (nothing, if it was
    gone already), and it is gone."""
    before = x.state
    if ok:
        s.end(x)
    for r in results:
        r.state = before if ok else State.GONE
        s.add(r)


def hb_dup_make(s: Sess) -> None:
    """Defect 4's shape: two arrays named on one host buffer before it is uploaded."""
    rng = s.f.rng
    value = s.value((8,))
    hb = s.new()
    arrays = []
    for _ in range(2):
        d = rng.choice(s.devices)
        arr = _make_on(s, hb, value, d)
        arrays.append(arr)
    s.store(hb, value.tobytes())
    for arr in arrays:
        s.read(arr)
    _probe(s)


def hb_dup_shards(s: Sess) -> None:
    """Defect 4's other shape: one host buffer named for two shards."""
    rng = s.f.rng
    devices = tuple(rng.sample(s.devices, min(2, len(s.devices))))
    half = s.value((4,))
    arr = s.add(Arr(s.new(), np.concatenate([half] * len(devices)), devices, "tiled",
                    State.MAYBE, s.family()))
    hb = s.new()
    body = s.msg("MakeArraysFromHostBufferShardsRequest", array_handles=[arr.handle])
    spec = body.specs.add()
    spec.array_spec.CopyFrom(array_spec(s.s, F32, [4 * len(devices)],
                                        s.sharding("tiled", devices)))
    for i in range(len(devices)):
        spec.addressable_shard_indices.add(indices=[i])
        buffer = spec.host_buffers.add(host_buffer_handle=hb)
        buffer.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
        buffer.shape.dims.extend([4])
    s.request("make_arrays_from_host_buffer_shards_request", body, expect="any",
              then=lambda r, ok: None if ok else setattr(arr, "state", State.GONE))
    s.store(hb, half.tobytes())
    s.read(arr)
    _probe(s)


def _probe(s: Sess) -> None:
    """A fresh upload and read on the session: it still works."""
    s.settle()
    if not s.broken:
        probe = s.make(s.value((8,)), (s.f.rng.choice(s.devices),), "single")[0]
        s.read(probe)


def hb_store_twice(s: Sess) -> None:
    value = s.value((8,))
    hb = s.new()
    s.store(hb, value.tobytes())
    s.store(hb, value.tobytes())
    d = s.f.rng.choice(s.devices)
    arr = s.add(Arr(s.new(), value, (d,), "single", State.MAYBE, s.family()))
    body = s.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=hb, array_handle=arr.handle)
    body.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend([8])
    body.sharding.CopyFrom(s.sharding("single", (d,)))
    s.request("make_array_from_host_buffer_request", body, expect="any",
              then=lambda r, ok: None if ok else setattr(arr, "state", State.GONE))
    s.read(arr)
    _probe(s)


def hb_reupload(s: Sess) -> None:
    """A host-buffer handle used once, uploaded again and used again."""
    rng = s.f.rng
    d = rng.choice(s.devices)
    hb = s.new()
    for _ in range(2):
        value = s.value((8,))
        s.store(hb, value.tobytes())
        arr = _make_on(s, hb, value, d)
        s.read(arr)
        s.settle()
        if s.broken:
            return


# Shapes and byte strides a client may send, with the size of the buffer it uploads.
HOSTILE: tuple[tuple[str, list[int], list[int] | None, int], ...] = (
    ("negative dim", [-3, 2], None, 24),
    ("dims overflow int64", [1 << 40, 1 << 30], None, 16),
    ("zero-size with a huge dim", [3, 0, 1 << 62], None, 0),
    ("huge dim, 16 bytes", [1 << 37], None, 16),
    ("f32[2**22] stride 0 from 4 bytes", [1 << 22], [0], 4),
    ("f32[2**37] stride 0 from 16 bytes", [1 << 37], [0], 16),
    ("negative stride", [4], [-4], 16),
    ("stride past the buffer", [4], [64], 16),
    ("unaligned stride", [4], [3], 16),
    ("overlapping rows", [3, 4], [4, 4], 24),
    ("broadcast row", [3, 4], [0, 4], 16),
    ("strides of the wrong rank", [2, 2], [4], 16),
    ("product wraps int64", [1 << 32, 1 << 32, 4], None, 64),
    ("short buffer", [8], None, 16),
    ("long buffer", [4], None, 64),
    ("huge stride", [2], [1 << 62], 8),
    ("huge negative stride", [2], [-(1 << 62)], 8),
)
AMPLIFICATION = 64  # a view may be this many times its buffer (past 1 MiB it must not)


def hostile_value(shape: list[int], strides: list[int] | None, data: bytes
                  ) -> np.ndarray | None:
    """What an f32 array of `shape` read from `data` with byte `strides` holds, or None
    where the server must refuse it: a negative dimension, a size past int64, a byte outside
    the buffer (C++ reads no byte before the buffer's start), a buffer of the wrong size
    without strides, or more than AMPLIFICATION times the buffer (over 1 MiB)."""
    if any(d < 0 for d in shape):
        return None
    count = 1
    for d in shape:
        count *= d
    nbytes = count * 4
    if nbytes >= 1 << 63 or any(d >= 1 << 62 for d in shape) and count:
        return None
    if count == 0:
        return np.zeros([0], np.float32)  # reads back as no bytes
    if strides is None:
        if len(data) != nbytes:
            return None
        return np.frombuffer(data, np.float32).reshape(shape)
    if len(strides) != len(shape):
        return None
    low = sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
    high = sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
    if low < 0 or high + 4 > len(data):
        return None
    if nbytes > (1 << 20) and nbytes > AMPLIFICATION * len(data):
        return None
    raw = np.frombuffer(data, np.uint8)
    view = np.lib.stride_tricks.as_strided(raw, shape=(*shape, 4), strides=(*strides, 1))
    return np.ascontiguousarray(view).view(np.float32).reshape(shape)


def shape_hostile(s: Sess) -> None:
    """Defects 8 and 9's shapes: shapes and strides that overflow, amplify or leave the
    buffer must be refused before anything is allocated; odd but legal views must hold the
    right values."""
    rng = s.f.rng
    name, shape, strides, size = rng.choice(HOSTILE)
    s.label += f"[{name}]"
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    expected = hostile_value(shape, strides, data)
    hb = s.new()
    d = rng.choice(s.devices)
    small = expected is not None and expected.nbytes <= 1 << 16
    arr = s.add(Arr(s.new(), expected if small else np.zeros(1, np.float32), (d,), "single",
                    State.GONE if expected is None else State.MAYBE, s.family(),
                    big=not small))
    body = s.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=hb, array_handle=arr.handle)
    body.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend(shape)
    body.sharding.CopyFrom(s.sharding("single", (d,)))
    if strides is not None:
        body.byte_strides.strides.extend(strides)
    s.request("make_array_from_host_buffer_request", body, expect="any",
              then=lambda r, ok: None if ok else setattr(arr, "state", State.GONE))
    s.store(hb, data)
    if small:
        s.read(arr)
    else:
        s.ready(arr, expect_gone=expected is None)
    _probe(s)


def shape_strided_ok(s: Sess) -> None:
    """Legal strided views: padded rows, a broadcast row (stride 0), column-major."""
    rng = s.f.rng
    d = rng.choice(s.devices)
    case = rng.choice(("padded", "broadcast", "fortran"))
    base = s.value((4, 6))
    if case == "padded":
        value, data, strides = base[:, :4], base.tobytes(), [24, 4]
        data = data[:24 * 3 + 16]  # the minimal region
    elif case == "broadcast":
        row = s.value((4,))
        value, data, strides = np.broadcast_to(row, (3, 4)), row.tobytes(), [0, 4]
    else:
        value, data, strides = base, np.asfortranarray(base).T.tobytes(), [4, 16]
    value = np.ascontiguousarray(value)
    hb = s.new()
    arr = s.add(Arr(s.new(), value, (d,), "single", State.MAYBE, s.family()))
    body = s.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=hb, array_handle=arr.handle)
    body.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend(value.shape)
    body.sharding.CopyFrom(s.sharding("single", (d,)))
    body.byte_strides.strides.extend(strides)
    s.request("make_array_from_host_buffer_request", body, expect="any",
              then=lambda r, ok: None if ok else setattr(arr, "state", State.GONE))
    s.store(hb, data)
    s.read(arr)


I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def remap_hostile(s: Sess) -> None:
    """Defect 7's shape and its relatives: intervals the arrays do not have."""
    pair = remap_inputs(s)
    if pair is None:
        return
    a, b = pair
    rng = s.f.rng
    plan = remap_plan(s, a, b)
    m = plan.mappings[rng.randrange(2)]
    field = rng.choice(("from", "to"))
    start, end, step = case = rng.choice(((I64_MIN, I64_MAX, 1), (0, I64_MAX, 1), (-2, 2, 1),
                                   (0, 2, 0), (2, 0, -1), (0, 3, 1), (0, 1 << 62, 1 << 61),
                                   (I64_MAX - 1, I64_MAX, 1)))
    s.label += f"[{field} {case}]"
    getattr(m, f"{field}_start")[:] = [start]
    getattr(m, f"{field}_end")[:] = [end]
    getattr(m, f"{field}_step")[:] = [step]
    if rng.random() < 0.2:
        m.in_array = rng.choice((2, -1, 1 << 30))
    out = s.add(Arr(s.new(), np.zeros(16, np.float32), a.devices + b.devices, "tiled",
                    State.GONE, a.family))
    body = s.msg("RemapArraysRequest", array_handles=[a.handle, b.handle],
                 result_handles=[out.handle], copy_semantics=REUSE_INPUT)
    body.plan.CopyFrom(plan)
    s.request("remap_arrays_request", body, expect="any")
    s.ready(out, expect_gone=True)
    s.read(a)
    s.read(b)


def compile_bad_options(s: Sess) -> None:
    """Defect 2's shape and its relatives: build options jaxlib trusts."""
    rng = s.f.rng
    program = rng.choice([p for p in PROGRAMS if p.devices <= len(s.devices)])
    devices = s.program_devices(program)
    options = s.compile_options(devices)
    b = options.compile_options.executable_build_options
    case = rng.choice(("device_ordinal", "no_assignment_ordinal", "duplicate_device",
                       "unknown_device", "replica_count", "partitions", "process_index",
                       "portable", "no_spmd", "computation_count", "mesh"))
    s.label += f"[{case}]"
    if case == "device_ordinal":
        b.device_ordinal = rng.choice((len(s.devices), 100, -2, (1 << 31) - 1))
    elif case == "no_assignment_ordinal":
        b.ClearField("device_assignment")
        b.device_ordinal = rng.choice((len(s.devices), 100, -2, 0))
    elif case == "duplicate_device" and len(devices) > 1:
        b.device_assignment.computation_devices[1].replica_device_ids[0] = devices[0]
    elif case == "unknown_device":
        b.device_assignment.computation_devices[0].replica_device_ids[0] = rng.choice(
            (99, -1, 1 << 31))
    elif case == "replica_count":
        b.device_assignment.replica_count = rng.choice((0, 2, -1))
    elif case == "partitions":
        b.num_partitions = rng.choice((0, len(devices) * 2, -1))
    elif case == "process_index":
        b.process_index, b.process_count = rng.choice(((5, 1), (-1, 1), (0, 0), (1, 2)))
    elif case == "portable":
        options.compile_options.compile_portable_executable = True
    elif case == "no_spmd":
        b.use_spmd_partitioning = False
    elif case == "computation_count":
        b.device_assignment.computation_count = len(devices) + 1
    elif case == "mesh":
        b.auto_spmd_partitioning_mesh_shape[:] = [len(devices), 2]
        b.auto_spmd_partitioning_mesh_ids[:] = list(range(len(devices) * 2))
    pending = s.compile(program, devices, options, trusted=False)
    s.settle()
    if pending.response is not None and status_of(pending.response)[0] == 0:
        exe = s.exes[pending.response.compile_response.loaded_executable_handle]
        out = s.execute(exe, s.args_for(exe), state=State.MAYBE, expect="any")
        s.read(out)


def compile_wrong_devices(s: Sess) -> None:
    """A program compiled for a device count it was not lowered for."""
    rng = s.f.rng
    # (Grid layouts exist over 4 devices only: the model cannot follow them elsewhere.)
    program = rng.choice([p for p in PROGRAMS if p.devices <= len(s.devices)
                          and "grid" not in (p.out.layout, *(a.layout for a in p.args))])
    n = rng.choice([k for k in (1, 2, 4, 3) if k <= len(s.devices) and k != program.devices])
    pending = s.compile(program, tuple(rng.sample(s.devices, n)), trusted=False)
    s.settle()
    if pending.response is not None and status_of(pending.response)[0] == 0:
        exe = s.exes[pending.response.compile_response.loaded_executable_handle]
        out = s.execute(exe, [s.ensure(exe.devices, "replicated" if n > 1 else "single",
                                       a.shape) for a in program.args],
                        state=State.MAYBE, expect="any")
        s.read(out)


def empty_request(s: Sess) -> None:
    """Defect 11's shape: a request of any kind with an empty body."""
    kinds = [f.name for f in s.s["xla.ifrt.proxy.IfrtRequest"].DESCRIPTOR.oneofs[0].fields
             if f.name != "init_request"]
    for kind in s.f.rng.sample(kinds, 3):
        s.request(kind, None, expect="any")


def array_bad(s: Sess) -> None:
    """Moves the arrays cannot make: mismatched devices, shapes, kinds, counts."""
    rng = s.f.rng
    arr = s.pick(lambda a: not a.big)
    if arr is None:
        return make_read(s)
    case = rng.choice(("copy_count", "copy_unknown_device", "copy_memory", "reshard_shape",
                       "bitcast_size", "disassemble_count", "assemble_devices",
                       "replicated_shard_of_tiled", "reshard_dtype"))
    s.label += f"[{case}]"
    out = s.add(Arr(s.new(), arr.value, arr.devices, arr.layout, State.MAYBE, arr.family,
                    arr.memory))
    gone = lambda r, ok: setattr(out, "state", State.GONE)  # noqa: E731
    if case == "copy_count":
        devices = list(arr.devices) + [d for d in s.devices if d not in arr.devices][:1]
        if len(devices) == len(arr.devices):
            devices = devices[:-1]
        s.request("copy_arrays_request", s.msg(
            "CopyArraysRequest", array_handles=[arr.handle], device_ids=devices,
            copy_semantics=REUSE_INPUT, result_handles=[out.handle]), expect="any", then=gone)
        out.state = State.GONE
    elif case == "copy_unknown_device":
        devices = [rng.choice((99, -1, (1 << 31) - 1))] * len(arr.devices)
        out.state = State.GONE
        s.request("copy_arrays_request", s.msg(
            "CopyArraysRequest", array_handles=[arr.handle], device_ids=devices,
            copy_semantics=ALWAYS_COPY, result_handles=[out.handle]), expect="any")
    elif case == "copy_memory":
        body = s.msg("CopyArraysRequest", array_handles=[arr.handle],
                     device_ids=list(arr.devices), copy_semantics=ALWAYS_COPY,
                     result_handles=[out.handle], memory_kind="no_such_memory")
        out.state = State.GONE
        s.request("copy_arrays_request", body, expect="any")
    elif case in ("reshard_shape", "reshard_dtype"):
        shape = list(arr.value.shape)
        kind = F32 if arr.value.dtype == np.float32 else S32
        if case == "reshard_shape":
            shape[0] *= 2
        else:
            kind = "KIND_S64"
        body = s.msg("ReshardArraysRequest", array_handles=[arr.handle],
                     result_handles=[out.handle], copy_semantics=ALWAYS_COPY)
        body.array_specs.append(array_spec(s.s, kind, shape, s.sharding(
            arr.layout, arr.devices, rank=len(shape))))
        out.state = State.GONE
        s.request("reshard_arrays_request", body, expect="any")
    elif case == "bitcast_size":
        body = s.msg("BitcastArraysRequest", array_handles=[arr.handle],
                     result_handles=[out.handle], copy_semantics=REUSE_INPUT)
        body.array_specs.append(array_spec(s.s, "KIND_S64", list(arr.value.shape),
                                           s.sharding(arr.layout, arr.devices,
                                                      rank=arr.value.ndim)))
        out.state = State.GONE
        s.request("bitcast_arrays_request", body, expect="any")
    elif case == "disassemble_count":
        n = len(arr.devices)
        handles = [s.new() for _ in range(n + (1 if n == 1 else rng.choice((1, -1))))]
        out.state = State.GONE
        s.request("disassemble_into_single_device_arrays_request", s.msg(
            "DisassembleIntoSingleDeviceArraysRequest", array_handle=arr.handle,
            copy_semantics=REUSE_INPUT, result_handles=handles), expect="any")
        for h in handles:
            s.add(Arr(h, np.zeros(1, np.float32), arr.devices[:1], "single", State.GONE,
                      arr.family, big=True))
    elif case == "assemble_devices":
        if len(s.devices) < 2:
            return
        part = s.ensure((s.devices[0],), "single", (4,))
        body = s.msg("AssembleArrayFromSingleDeviceArraysRequest",
                     single_device_array_handles=[part.handle], copy_semantics=REUSE_INPUT,
                     result_handle=out.handle)
        body.shape.dims.extend([8])
        body.sharding.CopyFrom(s.sharding("tiled", (s.devices[1], s.devices[0])))
        out.state = State.GONE
        s.request("assemble_array_from_single_device_arrays_request", body, expect="any")
    else:
        tiled = s.ensure(s.devices[:2], "tiled", (8,)) if len(s.devices) >= 2 else arr
        if tiled.layout != "tiled" or len(tiled.devices) < 2:
            return
        out.value, out.devices, out.layout = tiled.value, tiled.devices[:1], "single"
        out.state = State.GONE
        s.request("fully_replicated_shard_request", s.msg(
            "FullyReplicatedShardRequest", array_handle=tiled.handle,
            copy_semantics=REUSE_INPUT, result_handle=out.handle), expect="any")
    s.read(out)
    s.read(arr)


def session_abandon(s: Sess) -> None:
    """A session that ends with work in flight and an upload never sent; the fuzzer opens a
    fresh one in its place."""
    rng = s.f.rng
    late, _ = s.make(s.value((8,)), (rng.choice(s.devices),), "single", late=True)
    exe = next(iter(s.exes.values()), None)
    if exe is not None:
        s.execute(exe, [late] * len(exe.program.args), state=State.MAYBE, expect="any")
    s.inflight.clear()
    s.broken = True  # closed and replaced by the run loop


def _execute_mutation(change: Callable[[Sess, Exe, list[Arr]], list[Arr] | None]) -> Episode:
    def episode(s: Sess) -> None:
        _mutated_execute(s, lambda exe, args: change(s, exe, args))
    episode.__doc__ = change.__doc__
    return episode


EPISODES: dict[str, tuple[float, Episode]] = {
    "ok/make_read": (6, ok.make_read),
    "ok/execute": (8, ok.execute_ok),
    "ok/chain": (2, ok.chain),
    "ok/disassemble": (2, ok.disassemble),
    "ok/assemble": (2, ok.assemble),
    "ok/copy_arrays": (2, ok.copy_arrays),
    "ok/reshard": (2, ok.reshard),
    "ok/bitcast": (1.5, ok.bitcast),
    "ok/remap": (1.5, ok.remap),
    "ok/replicated_shard": (1.5, ok.replicated_shard),
    "ok/delete_destruct": (3, ok.delete_destruct),
    "ok/ready": (1, ok.ready_many),
    "ok/compile": (0.5, ok.compile_ok),
    "ok/executable_queries": (1, ok.executable_queries),
    "ok/error_arrays": (0.5, ok.error_arrays),
    "exec/swap_layout": (2, _execute_mutation(_swap_layout)),
    "exec/permuted_devices": (2, _execute_mutation(_permute)),
    "exec/other_devices": (1.5, _execute_mutation(_other_devices)),
    "exec/memory_kind": (1.5, _execute_mutation(_memory_kind)),
    "exec/shape_dtype": (1.5, _execute_mutation(_shape_dtype)),
    "exec/arg_count": (1, _execute_mutation(_arg_count)),
    "exec/bad_handle": (1.5, _execute_mutation(_bad_handle)),
    "exec/same_arg_donated": (1, exec_same_arg_donated),
    "exec/device_ids": (0.5, exec_device_ids),
    "exec/non_donatable": (0.5, exec_non_donatable),
    "exec/bad_executable": (1, exec_bad_executable),
    "exec/ready_then_donate": (1.5, exec_ready_then_donate),
    "order/late_upload": (3, order_late_upload),
    "hb/dup_make": (1, hb_dup_make),
    "hb/dup_shards": (1, hb_dup_shards),
    "hb/store_twice": (0.5, hb_store_twice),
    "hb/reupload": (0.5, hb_reupload),
    "shape/hostile": (1.5, shape_hostile),
    "shape/strided_ok": (1, shape_strided_ok),
    "remap/hostile": (1.5, remap_hostile),
    "compile/bad_options": (1, compile_bad_options),
    "compile/wrong_devices": (0.5, compile_wrong_devices),
    "empty/request": (1.5, empty_request),
    "array/bad": (2, array_bad),
    "session/abandon": (0.2, session_abandon),
    **fuzz_bytes.EPISODES,  # damaged program bytes, compile options and shardings
}


def _make_on(s: Sess, hb: int, value: np.ndarray, device: int) -> Arr:
    """MakeArrayFromHostBuffer of f32 `value` on `device` from host buffer `hb`, which may
    be refused (the array is then gone)."""
    arr = s.add(Arr(s.new(), value, (device,), "single", State.MAYBE, s.family()))
    body = s.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=hb,
                 array_handle=arr.handle)
    body.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend(value.shape)
    body.sharding.CopyFrom(s.sharding("single", (device,)))
    s.request("make_array_from_host_buffer_request", body, expect="any",
              then=lambda r, ok: None if ok else setattr(arr, "state", State.GONE))
    return arr
