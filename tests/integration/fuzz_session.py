"""One fuzzing session: a RawSession, the model of what it holds, and the building blocks
episodes use (arrays in every sharding form, reads checked against the model, compiles,
executes). Every request goes through `Sess.request`; `Sess.settle` waits for the answers
and checks them (see `fuzzer.py` for the kinds of finding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from tests.integration import fuzz_programs
from tests.integration.fuzz_model import F32, INTERNAL, S32, Arr, Exe, State, shard_groups, short
from tests.integration.fuzz_programs import Program
from tests.integration.rawclient import (
    RawSession,
    has_body,
    replicated_sharding,
    status_of,
    tiled_sharding,
)

if TYPE_CHECKING:
    from tests.integration.fuzzer import Fuzzer


class Pending:
    """One request in flight and what to do with its answer."""
    __slots__ = ("label", "kind", "body", "op_id", "expect", "needs", "then", "response")

    def __init__(self, label: str, kind: str | None, body: str, op_id: int, expect: str,
                 needs: Sequence[Arr], then: Callable[[Any, bool], None] | None) -> None:
        self.label, self.kind, self.body, self.op_id = label, kind, body, op_id
        self.expect, self.needs, self.then = expect, needs, then  # expect: ok | any
        self.response: Any = None


class Sess:
    """One session and the fuzzer's model of what it holds."""

    MAX_ARRAYS, MAX_EXES, MAX_DEAD = 40, 6, 32

    def __init__(self, fuzzer: Fuzzer, raw: RawSession) -> None:
        self.f, self.raw, self.s = fuzzer, raw, raw.s
        self.devices = list(raw.devices)
        self.arrays: dict[int, Arr] = {}
        self.exes: dict[int, Exe] = {}
        self.dead: list[int] = []  # destructed handles (arrays and executables)
        self.inflight: list[Pending] = []
        self.after: list[Callable[[], None]] = []  # reads to finish after settling
        self.broken = False
        self.label = ""

    # ---- sending and settling --------------------------------------------------------

    def new(self) -> int:
        return self.f.new_handle()

    def msg(self, name: str, **fields: Any) -> Any:
        return self.raw.msg(name, **fields)

    def request(self, kind: str | None, body: Any = None, *, expect: str = "ok",
                needs: Sequence[Arr] = (), text: str | None = None,
                then: Callable[[Any, bool], None] | None = None) -> Pending:
        """Sends a request now; `then(response, ok)` runs at settle time, in send order.
        `expect="ok"`: an error answer is a finding (a well-formed request), unless one of
        the arrays it `needs` is not OK by then (the model as of this request's turn)."""
        op = self.raw.send(kind, body)
        text = text or short(body, 300)
        self.f.episode_log.append(f"{kind} {text}")
        if self.f.trace is not None:
            self.f.trace.append(f"{self.label} s{self.raw.session_id} #{op} {kind} {text}")
        pending = Pending(self.label, kind, text, op, expect, tuple(needs), then)
        self.inflight.append(pending)
        self.f.sent += 1
        self.f.kinds[kind or "none"] += 1
        return pending

    def store(self, handle: int, data: bytes) -> bool:
        """Uploads a host buffer; a refused upload is fine, an INTERNAL one a finding."""
        self.f.sent += 1
        try:
            self.raw.store(handle, data)
            return True
        except grpc.RpcError as e:
            self._rpc_error("HostBufferStore", handle, e)
            return False

    def _rpc_error(self, what: str, handle: int, e: grpc.RpcError) -> None:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.f.find("hang", self.label, f"{what}(handle={handle})", "no answer")
            self.broken = True
        elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) or \
                "bug in isthmus" in (e.details() or ""):
            self.f.find("internal", self.label, f"{what}(handle={handle})",
                        f"{code.name}: {e.details()}")
        elif code == grpc.StatusCode.UNAVAILABLE:
            self.f.check_processes(self.label)

    def settle(self) -> list[Any]:
        """Waits for every request in flight, checks each answer, runs the model updates
        in send order, then finishes the reads. Returns the responses (None: no answer)."""
        out = []
        for p in self.inflight:
            if not self.broken:
                p.response = self._wait(p)
            out.append(p.response)
        inflight, self.inflight = self.inflight, []
        for p in inflight:
            ok = p.response is not None and status_of(p.response)[0] == 0
            if p.response is not None:
                self._check(p)
            if p.then is not None:
                p.then(p.response, ok)
        after, self.after = self.after, []
        for fn in after:
            if not self.broken:
                fn()
        return out

    def _wait(self, p: Pending) -> Any:
        try:
            response = self.raw.wait(p.op_id, self.f.timeout)
        except (TimeoutError, AssertionError):
            self.f.find("hang", p.label, self.describe(p), f"no answer in {self.f.timeout} s")
            self.broken = True
            return None
        except grpc.RpcError as e:
            self.f.check_processes(p.label)
            self.f.find("session_closed", p.label, self.describe(p),
                        f"{e.code().name}: {e.details()}")
            self.broken = True
            return None
        return response

    def _check(self, p: Pending) -> None:
        code, message = status_of(p.response)
        self.f.statuses[code] += 1
        if code:
            key = (p.label.split("[")[0], code)
            self.f.errors[key] += 1
            self.f.error_examples.setdefault(key, f"{self.describe(p)} -> {message}")
        if code == INTERNAL or "bug in isthmus" in message:
            self.f.find("internal", p.label, self.describe(p), f"{code}: {message}")
        elif code == 0 and not has_body(p.response):
            self.f.find("no_body", p.label, self.describe(p), "OK with the oneof unset")
        elif code != 0 and p.expect == "ok" and all(a.state == State.OK for a in p.needs):
            self.f.find("spurious_error", p.label, self.describe(p), f"{code}: {message}")

    def describe(self, p: Pending) -> str:
        return f"{p.kind}{{{p.body}}}"

    # ---- the model -----------------------------------------------------------------

    def add(self, arr: Arr) -> Arr:
        self.arrays[arr.handle] = arr
        return arr

    def family(self) -> int:
        return self.f.new_handle()

    def maybe_end(self, arr: Arr) -> None:
        """`arr` may be deleted or donated (and so may its sharers)."""
        before = arr.state
        self.end(arr)
        arr.state = max(before, State.MAYBE)

    def end(self, arr: Arr, sharers: State = State.MAYBE) -> None:
        """`arr` is deleted or donated: it is gone, its sharers may be."""
        arr.state = State.GONE
        for other in self.arrays.values():
            if other.family == arr.family and other is not arr:
                other.state = max(other.state, sharers)

    def live(self, pred: Callable[[Arr], bool] = lambda a: True) -> list[Arr]:
        return [a for a in self.arrays.values() if a.state != State.GONE and pred(a)]

    def pick(self, pred: Callable[[Arr], bool] = lambda a: True) -> Arr | None:
        found = self.live(pred)
        return self.f.rng.choice(found) if found else None

    # ---- building blocks: shardings and arrays ---------------------------------------

    def sharding(self, layout: str, devices: Sequence[int], memory: str = "",
                 rank: int = 1) -> Any:
        devices = list(devices)
        if layout == "tiled":
            return tiled_sharding(self.s, devices, [len(devices)] + [1] * (rank - 1), memory)
        if layout == "grid":
            return tiled_sharding(self.s, devices, [2, 2], memory)
        if layout == "single" and len(devices) == 1 and self.f.rng.random() < 0.2 \
                and not memory:
            sharding = self.s["xla.ifrt.ShardingProto"]()
            single = self.s["xla.ifrt.SingleDeviceShardingProto"](device_id=devices[0])
            sharding.serialized_sharding.type_name = "xla::ifrt::SingleDeviceSharding"
            sharding.serialized_sharding.data = single.SerializeToString()
            return sharding
        return replicated_sharding(self.s, devices, memory)

    def value(self, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """Small integers as floats: sums and products stay exact."""
        data = [self.f.rng.randint(-64, 64) for _ in range(int(np.prod(shape)))]
        return np.asarray(data, dtype=dtype).reshape(shape)

    def make(self, value: np.ndarray, devices: Sequence[int], layout: str, *,
             memory: str = "", form: str = "whole", late: bool = False,
             state: State = State.OK, expect: str = "ok") -> tuple[Arr, Callable[[], None]]:
        """Makes an array of `value` (f32 or s32) sharded as `layout` over `devices`.
        `form`: whole (MakeArrayFromHostBuffer), shards (MakeArraysFromHostBufferShards) or
        strided (a whole buffer in column-major order with byte strides). Returns the model
        array and its upload; with `late` the caller sends the upload (after more requests)."""
        kind = F32 if value.dtype == np.float32 else S32
        arr = Arr(self.new(), value, tuple(devices), layout, state, self.family(), memory)
        uploads: list[tuple[int, bytes]] = []
        sharding = self.sharding(layout, devices, memory, value.ndim)
        if form == "shards":
            body = self.msg("MakeArraysFromHostBufferShardsRequest", array_handles=[arr.handle])
            spec = body.specs.add()
            spec.array_spec.dtype.kind = self.s["xla.ifrt.DTypeProto"].Kind.Value(kind)
            spec.array_spec.shape.dims.extend(value.shape)
            spec.array_spec.sharding.CopyFrom(sharding)
            for indices, box in shard_groups(layout, value.shape, len(devices)):
                piece = np.ascontiguousarray(value[box])
                hb = self.new()
                spec.addressable_shard_indices.add(indices=indices)
                buffer = spec.host_buffers.add(host_buffer_handle=hb)
                buffer.dtype.kind = spec.array_spec.dtype.kind
                buffer.shape.dims.extend(piece.shape)
                uploads.append((hb, piece.tobytes()))
            request_kind = "make_arrays_from_host_buffer_shards_request"
        else:
            hb = self.new()
            body = self.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=hb,
                            array_handle=arr.handle)
            body.dtype.kind = self.s["xla.ifrt.DTypeProto"].Kind.Value(kind)
            body.shape.dims.extend(value.shape)
            body.sharding.CopyFrom(sharding)
            if form == "strided" and value.ndim == 2:
                data = np.asfortranarray(value)
                body.byte_strides.strides.extend(data.strides)
                uploads.append((hb, data.T.tobytes()))
            else:
                if self.f.rng.random() < 0.5:
                    body.byte_strides.strides.extend(np.ascontiguousarray(value).strides)
                uploads.append((hb, value.tobytes()))
            request_kind = "make_array_from_host_buffer_request"

        def upload() -> None:
            for handle, data in uploads:
                self.store(handle, data)

        if not late:
            upload()
        self.add(arr)
        self.request(request_kind, body, expect=expect, then=lambda r, ok: self._made(arr, ok))
        return arr, upload

    def _made(self, arr: Arr, ok: bool) -> None:
        if not ok:
            arr.state = State.GONE

    def ensure(self, devices: Sequence[int], layout: str, shape: Sequence[int], *,
               memory: str = "", reuse: float = 0.7) -> Arr:
        """A live f32 array of that shape and sharding: one the session holds, or a new one."""
        devices = tuple(devices)
        if layout == "grid" and len(devices) != 4:  # for a program built over other devices
            layout = "tiled"
        if self.f.rng.random() < reuse:
            found = self.pick(lambda a: a.devices == devices and a.layout == layout and
                              a.value.shape == tuple(shape) and a.memory == memory and
                              a.value.dtype == np.float32 and not a.big)
            if found is not None:
                return found
        form = self.f.rng.choice(("whole", "whole", "shards", "strided"))
        return self.make(self.value(shape), devices, layout, memory=memory, form=form)[0]

    # ---- reads -----------------------------------------------------------------------

    def read(self, arr: Arr, *, strides: bool = False) -> None:
        """CopyToHostBuffer now; at settle time the bytes are looked up and compared with
        the model as it stood when the copy was sent."""
        hb = self.new()
        body = self.msg("CopyToHostBufferRequest", array_handle=arr.handle, host_buffer_handle=hb)
        if strides:
            body.byte_strides.strides.extend(np.ascontiguousarray(arr.value).strides)
        seen: dict[str, Any] = {}

        def then(response: Any, ok: bool) -> None:
            seen["state"], seen["value"] = arr.state, arr.value
            if response is None:
                return
            if not ok:
                code, message = status_of(response)
                if arr.state == State.OK and code != INTERNAL:
                    self.f.find("spurious_error", self.label,
                                f"read of {self._about(arr)}", f"{code}: {message}")
                return
            self.after.append(lambda: self._compare(arr, hb, seen["state"], seen["value"]))

        self.request("copy_to_host_buffer_request", body, expect="any", then=then)

    def _compare(self, arr: Arr, hb: int, state: State, value: np.ndarray) -> None:
        try:
            data = self.raw.lookup(hb)
        except grpc.RpcError as e:
            if state == State.OK or e.code() in (grpc.StatusCode.INTERNAL,
                                                 grpc.StatusCode.UNKNOWN,
                                                 grpc.StatusCode.DEADLINE_EXCEEDED):
                self._rpc_error("HostBufferLookup", hb, e)
                if state == State.OK and e.code() not in (grpc.StatusCode.INTERNAL,
                                                          grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.f.find("spurious_error", self.label, f"lookup of {self._about(arr)}",
                                f"{e.code().name}: {e.details()}")
            return
        self.f.sent += 1
        try:
            self.raw.delete_host_buffer(hb)
        except grpc.RpcError as e:
            self._rpc_error("HostBufferDelete", hb, e)
        self.f.sent += 1
        self.f.reads += 1
        if state == State.GONE:
            same = data == np.ascontiguousarray(value).tobytes()
            self.f.find("read_gone", self.label, f"read of {self._about(arr)}",
                        f"{len(data)} bytes came back "
                        f"({'its value before' if same else 'not its value before'})")
        elif data != np.ascontiguousarray(value).tobytes() and not _same_floats(data, value):
            if arr.family in self.f.tainted:
                return  # a wrong value already reported, seen again through a sharer
            self.f.tainted.add(arr.family)
            got = np.frombuffer(data, value.dtype) if len(data) == value.nbytes else data
            self.f.find("wrong_result", self.label, f"read of {self._about(arr)}",
                        f"got {short(got, 200)}, expected {short(value.ravel(), 200)}")

    def _about(self, arr: Arr) -> str:
        return (f"array {arr.handle} ({arr.value.dtype}{list(arr.value.shape)} {arr.layout} "
                f"over {list(arr.devices)}{' ' + arr.memory if arr.memory else ''}, "
                f"{arr.state.name})")

    def ready(self, *arrays: Arr, expect_gone: bool = False) -> Pending:
        """CheckValueReady; `expect_gone`: an OK answer is an `accepted` finding."""
        handles = [a.handle for a in arrays]

        def then(response: Any, ok: bool) -> None:
            if ok and expect_gone:
                self.f.find("accepted", self.label, f"check_value_ready of "
                            f"{[self._about(a) for a in arrays]}", "OK: the array exists")
            code, message = status_of(response) if response is not None else (0, "")
            if response is not None and not ok and code != INTERNAL and \
                    all(a.state == State.OK for a in arrays):
                self.f.find("spurious_error", self.label,
                            f"check_value_ready of {[self._about(a) for a in arrays]}",
                            f"{code}: {message}")

        return self.request("check_value_ready_request",
                            self.msg("CheckValueReadyRequest", value_handles=handles),
                            expect="any", then=then)

    # ---- programs --------------------------------------------------------------------

    def compile_options(self, devices: Sequence[int], **build: Any) -> Any:
        """XlaCompileOptions as jax writes them for an SPMD program over `devices`."""
        options = self.s["xla.ifrt.XlaCompileOptionsProto"]()
        b = options.compile_options.executable_build_options
        b.device_ordinal = -1
        b.num_replicas = 1
        b.num_partitions = len(devices)
        b.use_spmd_partitioning = True
        b.use_shardy_partitioner = True
        b.process_count = 1
        a = b.device_assignment
        a.replica_count = 1
        a.computation_count = len(devices)
        for d in devices:
            a.computation_devices.add(replica_device_ids=[d])
        for field, value in build.items():
            setattr(b, field, value)
        return options

    def compile(self, program: Program, devices: Sequence[int], options: Any = None, *,
                trusted: bool = True) -> Pending:
        body = self.msg("CompileRequest")
        body.program.type_name = "xla::ifrt::XlaProgram"
        body.program.data = self.f.programs[program.name]
        options = options if options is not None else self.compile_options(devices)
        body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
        body.compile_options.data = options.SerializeToString()

        def then(response: Any, ok: bool) -> None:
            if ok:
                handle = response.compile_response.loaded_executable_handle
                self.exes[handle] = Exe(handle, program, tuple(devices), trusted)

        build = options.compile_options.executable_build_options
        text = (f"program {program.name} (lowered for {program.devices} devices) over "
                f"{list(devices)}; build options: "
                f"{short(build, 400)}"
                + (" compile_portable_executable: true"
                   if options.compile_options.compile_portable_executable else ""))
        return self.request("compile_request", body, expect="ok" if trusted else "any",
                            text=text, then=then)

    def program_devices(self, program: Program) -> tuple[int, ...]:
        rng = self.f.rng
        devices = self.devices[:program.devices] if rng.random() < 0.7 else \
            rng.sample(self.devices, program.devices)
        return tuple(devices)

    def exe(self, pred: Callable[[Exe], bool] = lambda e: True) -> Exe | None:
        """An executable the session holds (compiling one first when it holds none)."""
        found = [e for e in self.exes.values() if pred(e)]
        if found and self.f.rng.random() < 0.9:
            return self.f.rng.choice(found)
        candidates = [p for p in fuzz_programs.PROGRAMS if p.devices <= len(self.devices)]
        for _ in range(20):
            program = self.f.rng.choice(candidates)
            devices = self.program_devices(program)
            if pred(Exe(0, program, devices, True)):
                self.compile(program, devices)
                self.settle()
                found = [e for e in self.exes.values() if pred(e)]
                return self.f.rng.choice(found) if found else None
        return None

    def args_for(self, exe: Exe) -> list[Arr]:
        """Well-formed arguments; a donated one shares no buffer with another argument."""
        args: list[Arr] = []
        for arg in exe.program.args:
            a = self.ensure(exe.devices, arg.layout, arg.shape)
            if exe.program.donate and any(a.family == b.family for b in args):
                a = self.ensure(exe.devices, arg.layout, arg.shape, reuse=0.0)
            args.append(a)
        return args

    def execute(self, exe: Exe, args: Sequence[Arr], *, state: State = State.OK,
                expect: str = "ok", server_minted: bool = False,
                tweak: Callable[[Any], None] | None = None) -> Arr:
        """Executes; returns the model of its output (its value from the numpy twin).
        `state`: the best the output can be (MAYBE for mutated calls)."""
        program = exe.program
        try:
            if any(a.value.dtype != np.float32 for a in args):
                raise TypeError
            value = program.fn(*(a.value for a in args)).astype(np.float32)
            if value.shape != program.out.shape:
                raise ValueError
        except (ValueError, TypeError):
            value = np.zeros(program.out.shape, np.float32)
            state = State.GONE  # no numpy answer: the call must fail
        out = Arr(0 if server_minted else self.new(), value, exe.devices, program.out.layout,
                  State.OK, self.family())
        body = self.msg("LoadedExecutableExecuteRequest", loaded_executable_handle=exe.handle,
                        args_handles=[a.handle for a in args])
        rng = self.f.rng
        status = None
        if not server_minted:
            body.result_array_handle.append(out.handle)
            if rng.random() < 0.3:
                status = self.new()
                body.result_status_handle = status
                body.execute_options.fill_status = True
        elif rng.random() < 0.3:
            body.execute_options.fill_status = True
        if tweak is not None:
            tweak(body)
        inputs = list(args)

        def then(response: Any, ok: bool) -> None:
            worst = max([state, *(a.state for a in inputs)] +
                        ([] if exe.trusted else [State.MAYBE]))
            if not ok:
                out.state = State.GONE
                for i in program.donate:
                    if i < len(inputs) and inputs[i].state != State.GONE:
                        inputs[i].state = max(inputs[i].state, State.MAYBE)
                if server_minted:
                    return
            else:
                out.state = worst
                if any(a.family in self.f.tainted for a in inputs):
                    self.f.tainted.add(out.family)  # computed from a wrong value
                if server_minted:
                    outputs = response.loaded_executable_execute_response.outputs
                    if len(outputs) != 1 or list(outputs[0].shape.dims) != list(value.shape):
                        self.f.find("bad_output", self.label, f"execute of {program.name}",
                                    short(response, 300))
                        return
                    out.handle = outputs[0].array_handle
                for i in program.donate:
                    if i < len(inputs):
                        # Built with odd options, the program may keep what it was given;
                        # either way its sharers may be gone with it.
                        self.end(inputs[i]) if exe.trusted else self.maybe_end(inputs[i])
            self.add(out) if out.handle else None

        if not server_minted:
            self.add(out)  # the handle is bound now, also when the call fails
        self.request("loaded_executable_execute_request", body,
                     expect=expect if exe.trusted else "any", needs=inputs,
                     then=then)
        if status is not None and rng.random() < 0.5:
            self.request("check_future_request",
                         self.msg("CheckFutureRequest", future_handle=status), expect="any")
        return out

    # ---- housekeeping ----------------------------------------------------------------

    def trim(self) -> None:
        """Keeps the session small: destructs the oldest arrays and executables."""
        extra = list(self.arrays)[:-self.MAX_ARRAYS] if len(self.arrays) > self.MAX_ARRAYS \
            else []
        extra += [h for h, a in list(self.arrays.items())[:-10] if a.state == State.GONE
                  and h not in extra]
        if extra:
            for h in extra:
                self.arrays.pop(h)
            self.request("destruct_array_request",
                         self.msg("DestructArrayRequest", array_handle=extra))
            self.dead = (self.dead + extra)[-self.MAX_DEAD:]
        while len(self.exes) > self.MAX_EXES:
            handle = next(iter(self.exes))
            self.exes.pop(handle)
            self.request("loaded_executable_destruct_request", self.msg(
                "LoadedExecutableDestructRequest", loaded_executable_handle=handle))
            self.dead = (self.dead + [handle])[-self.MAX_DEAD:]
        self.settle()

    def close(self) -> None:
        try:
            self.raw.close()
        except Exception:  # noqa: BLE001 - a broken stream closes as it can
            pass


def _same_floats(data: bytes, value: np.ndarray) -> bool:
    """Equal as XLA computes floats: subnormals flushed to zero (XLA:CPU flushes them, as
    local jax does; numpy does not), any NaN for a NaN (payloads are not kept)."""
    if value.dtype.kind != "f" or len(data) != value.nbytes:
        return False
    got = np.frombuffer(data, value.dtype).reshape(value.shape)
    tiny = np.finfo(value.dtype).tiny

    def flushed(x: np.ndarray) -> np.ndarray:
        return np.where(np.abs(x) < tiny, 0, x)

    return bool(np.array_equal(flushed(got), flushed(value), equal_nan=True))
