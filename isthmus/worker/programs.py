"""Compiling StableHLO programs with jaxlib and describing the result.

The client sends a StableHLO portable artifact (VHLO bytecode) with its global signature:
shapes in `main` are global, shardings are attributes. We read the signature (output types,
donated arguments) from the module itself and everything else (shardings, layouts, cost) from
the compiled executable.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

import numpy as np

from isthmus import dtypes, errors
from isthmus.compat import jax as jax_compat
from isthmus.compat.jaxlib_types import (
    CompileOptions,
    DeviceList,
    JaxlibClient,
    JaxlibDevice,
    JaxSharding,
    LoadedExecutable,
    MlirContext,
    MlirModule,
    MlirType,
    OpSharding,
    ResultHandler,
)
from isthmus.transport.records import Aval, CompiledInfo, CompileRequest, Signature


class ExecutableCache(Protocol):
    """Where `compile_program` keeps executables (`compile_cache.CompileCache` on disk, or
    `KeptExecutables` in memory before it)."""

    def program_digest(self, module: bytes, known: bytes = b"") -> bytes: ...

    def key(self, client: JaxlibClient, devices: Sequence[JaxlibDevice], program_digest: bytes,
            compile_options: bytes, device_ids: Sequence[int], replicas: int,
            namespace: str = "") -> str: ...

    def load(self, key: str, client: JaxlibClient, devices: DeviceList,
             options: CompileOptions) -> LoadedExecutable | None: ...

    def store(self, key: str, client: JaxlibClient, executable: LoadedExecutable,
              payload: bytes = b"") -> None: ...


logger = logging.getLogger(__name__)


# How this process's programs were made, for its figures (`DeviceHost.stats`): "compiled"
# here from the program, or "vetted": the vetting process's trial compile, loaded (those from
# a cache count as its hits).
LOADS: collections.Counter[str] = collections.Counter()
_LOADS_LOCK = threading.Lock()  # compiles run in several threads


_T = TypeVar("_T")
_D = TypeVar("_D")


def _count(how: str) -> None:
    with _LOADS_LOCK:
        LOADS[how] += 1

def parse_program(context: MlirContext, module: bytes) -> MlirModule:
    """The module of a program's bytes: a StableHLO portable artifact, or MLIR text or
    bytecode. Only for bytes this server wrote (`vetting`), or in the disposable process."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    try:
        return stablehlo.deserialize_portable_artifact(context, module)
    except Exception:  # noqa: BLE001 - not an artifact; maybe MLIR text or bytecode
        try:
            return ir.Module.parse(module)
        except Exception as e:  # noqa: BLE001
            raise errors.CompileError(
                f"the program does not parse as StableHLO ({_first_line(e)}); send a "
                "program lowered by jax.") from None


_SMALL = b"""module @warm_up {
  func.func public @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<2xf32>
    return %0 : tensor<2xf32>
  }
}"""


def warm_up() -> None:
    """Reads a small program's signature, as text and as a portable artifact, so that a
    process's first client program does not pay MLIR's first use (about 20 ms)."""
    from jaxlib.mlir.dialects import stablehlo

    context = jax_compat.make_ir_context()
    with context:
        parsed = parse_program(context, _SMALL)
        artifact = stablehlo.serialize_portable_artifact(
            parsed, stablehlo.get_current_version(), allow_other_dialects=True)
    parse_signature(artifact)


def canonical_digest(module: bytes) -> bytes:
    """SHA-256 of the program without its debug information (source locations), as jax's
    own cache keys it: the same program from an edited or moved script is the same entry."""
    import hashlib
    import io

    from jaxlib.mlir import passmanager

    context = jax_compat.make_ir_context()
    with context:
        parsed = parse_program(context, module)
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(parsed.operation)
        out = io.BytesIO()
        parsed.operation.write_bytecode(file=out)
    return hashlib.sha256(out.getvalue()).digest()


def parse_signature(module: bytes) -> Signature:
    """The signature of a program's bytes (only bytes this server wrote, or in the
    disposable process)."""
    context = jax_compat.make_ir_context()
    with context:
        return signature_of(parse_program(context, module))


def signature_of(parsed: MlirModule) -> Signature:
    """The signature of a parsed module (in its context)."""
    from jaxlib.mlir import ir

    name = "main"
    if "sym_name" in parsed.operation.attributes:
        name = ir.StringAttr(parsed.operation.attributes["sym_name"]).value
    main = None
    for op in parsed.body.operations:
        attrs = op.attributes
        if "sym_name" in attrs and ir.StringAttr(attrs["sym_name"]).value == "main":
            main = op
    if main is None:
        raise errors.CompileError(
            "the program has no `main` function; send a program lowered by jax.")
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    params = tuple(_aval(t) for t in ftype.inputs)
    outputs = tuple(_aval(t) for t in ftype.results)
    donated: list[int] = []
    donors: list[int] = []
    memory_kinds: list[str | None] = []
    if "arg_attrs" in main.attributes:
        for index, attr in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
            d = ir.DictAttr(attr)
            if "tf.aliasing_output" in d or "jax.buffer_donor" in d:
                donated.append(index)
                if "tf.aliasing_output" not in d:
                    donors.append(index)
            memory_kinds.append(ir.StringAttr(d["mhlo.memory_kind"]).value
                                if "mhlo.memory_kind" in d else None)
    if not any(memory_kinds):
        memory_kinds = []
    return Signature(name, params, outputs, tuple(donated), tuple(memory_kinds), tuple(donors))


def _aval(t: MlirType) -> Aval:
    from jaxlib.mlir import ir

    if isinstance(t, ir.RankedTensorType):
        tensor = t
        element = str(tensor.element_type)
        shape = tuple(int(d) for d in tensor.shape)
    else:
        element, shape = str(t), ()
    dtype = dtypes.BY_MLIR.get(element)
    if dtype is None:
        raise errors.CompileError(
            f"the program uses element type {element}, which isthmus cannot carry; use a "
            "dtype jax supports on CPU and GPU.")
    if any(d < 0 for d in shape):
        raise errors.CompileError(
            "the program has dynamically shaped inputs or outputs, which isthmus does not "
            "support; give every dimension a static size.")
    return Aval(dtype, shape)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def compile_program(client: JaxlibClient, devices: Sequence[JaxlibDevice],
                    request: CompileRequest, cache: ExecutableCache | None = None
                    ) -> tuple[LoadedExecutable, CompiledInfo]:
    """Compiles and loads `request` on `devices` (blocking); with a `CompileCache`, loads it
    from there when it was compiled before (and stores it there when not)."""
    import jax

    _jax, xc = jax_compat.jaxlib_extension(), jax_compat.xla_client()
    signature = request.signature or parse_signature(request.module)
    try:
        options = xc.CompileOptions.ParseFromString(request.compile_options)
    except Exception as e:  # noqa: BLE001
        raise errors.InvalidRequest(f"the compile options do not parse: {_first_line(e)}") from None
    # The client named devices by global id; the assignment must name this client's devices.
    options.executable_build_options.device_assignment = xc.DeviceAssignment.create(
        np.array([d.id for d in devices], dtype=np.int64).reshape(request.replicas, -1))
    device_list = _jax.DeviceList(tuple(devices))
    key, executable = "", None
    if cache is not None:
        digest = cache.program_digest(request.module, request.digest)
        key = cache.key(client, devices, digest, request.compile_options, request.device_ids,
                        request.replicas, request.namespace)
        executable = cache.load(key, client, device_list, options)
    fresh = executable is None  # not from the persistent cache: stored there once made
    payload = b""
    if executable is None and request.executable:
        try:  # compiled by the vetting process on its own devices (controller/vetting.py)
            executable = client.deserialize_executable(request.executable, device_list,
                                                        options)
            payload = request.executable
            _count("vetted")
        except Exception as e:  # noqa: BLE001 - compiled here instead
            logger.info("the vetted executable of %s does not load here (%s); compiling",
                        signature.name, _first_line(e))
    if executable is None:
        try:
            executable = client.compile_and_load(request.module, device_list, options)
        except Exception as e:  # noqa: BLE001
            raise compile_failure(e) from None
        _count("compiled")
    if cache is not None and fresh:
        cache.store(key, client, executable, payload)

    def shardings(values: Iterable[OpSharding] | None) -> tuple[bytes, ...] | None:
        return None if values is None else tuple(s.SerializeToString() for s in values)

    def optional(call: Callable[[], _T], default: _D) -> _T | _D:
        try:
            return call()
        except Exception:  # noqa: BLE001 - a backend may not implement every query
            return default

    stats = optional(executable.get_compiled_memory_stats, None)
    memory_stats = {} if stats is None else {
        field: int(getattr(stats, field)) for field in (
            "generated_code_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "temp_size_in_bytes", "host_generated_code_size_in_bytes",
            "host_argument_size_in_bytes", "host_output_size_in_bytes",
            "host_alias_size_in_bytes", "host_temp_size_in_bytes")
        if hasattr(stats, field)}
    memory_kinds: Sequence[Sequence[str]] = optional(executable.get_output_memory_kinds, [[]])
    fingerprint = optional(lambda: executable.fingerprint, None)
    param_layouts, param_layouts_error = _layouts(executable.get_parameter_layouts)
    output_layouts, output_layouts_error = _layouts(executable.get_output_layouts)
    # Which offered buffers XLA aliased is in the compiled module's header alone: printed
    # only for a program that offers some (`jax.buffer_donor`; jax names the output of the
    # rest), since a large program's text costs milliseconds (11 ms a program of a language
    # model on a TPU v5e).
    donated = signature.donated
    if signature.donors:
        donated = compiled_donations(optional(executable.get_hlo_text, ""), donated,
                                     signature.donors)
    info = CompiledInfo(
        name=signature.name,
        params=signature.params,
        outputs=signature.outputs,
        param_shardings=shardings(optional(executable.get_parameter_shardings, None)),
        output_shardings=shardings(optional(executable.get_output_shardings, None)),
        param_layouts=param_layouts,
        output_layouts=output_layouts,
        output_memory_kinds=tuple(memory_kinds[0]) if memory_kinds else (),
        donated_inputs=donated,
        fingerprint=fingerprint if isinstance(fingerprint, bytes) else None,
        memory_stats=memory_stats,
        generated_code_bytes=int(optional(executable.size_of_generated_code_in_bytes, 0)),
        param_avals=tuple(jax.core.ShapedArray(p.shape, p.dtype.numpy) if p.dtype.numpy is not None
                          else None for p in signature.params),
        param_memory_kinds=signature.param_memory_kinds,
        param_layouts_error=param_layouts_error,
        output_layouts_error=output_layouts_error,
    )
    return executable, info


def compile_failure(e: BaseException) -> errors.IsthmusError:
    """XLA's refusal of a program is the client's: INVALID_ARGUMENT with XLA's message,
    whatever code XLA gave it (a RET_CHECK of a pass is INTERNAL to XLA, not to us); only
    running out of memory keeps its own code."""
    error = errors.from_runtime_error(e, errors.CompileError, "compilation failed")
    if error.code not in (errors.Code.RESOURCE_EXHAUSTED, errors.Code.INVALID_ARGUMENT):
        error = errors.CompileError(error.message)
    return error


def _layouts(query: Callable[[], Iterable[object]]) -> tuple[tuple[str, ...], str]:
    """A layout query's answer as text, or why the backend has none (it raises
    UNIMPLEMENTED for token parameters and outputs, and jax then uses default layouts)."""
    try:
        return tuple(str(x) for x in query()), ""
    except Exception as e:  # noqa: BLE001 - passed on to the client as its answer
        return (), _first_line(e)


def compiled_donations(hlo_text: str, declared: tuple[int, ...],
                       donors: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The parameters the compiled program consumes, of those it declares: each that names
    its output (`tf.aliasing_output`), and of those that only offer their buffer (`donors`,
    `jax.buffer_donor`; None: all of `declared`) the ones XLA aliased to an output, read off
    the optimized module's header (`input_output_alias={ {0}: (1, {}, may-alias) }`). PjRt
    consumes those only: an offered buffer that no output could use (still listed as
    `buffer_donor={ (0, {}) }`) survives the call, locally and here. Without the header:
    `declared`."""
    header = hlo_text.split("\n", 1)[0]
    if not declared or not header.startswith("HloModule "):
        return declared
    offered = set(declared if donors is None else donors)
    used: set[int] = set()
    key = "input_output_alias={"
    start = header.find(key)
    if start >= 0:
        depth, end = 1, start + len(key)
        while end < len(header) and depth:
            depth += {"{": 1, "}": -1}.get(header[end], 0)
            end += 1
        used.update(int(n) for n in re.findall(r"\((\d+),", header[start:end]))
    return tuple(i for i in declared if i in used or i not in offered)


def program_text(executable: LoadedExecutable) -> str:
    """The compiled program as XLA prints it (`compiled.as_text()`); "" where the backend
    prints none."""
    try:
        return str(executable.get_hlo_text())
    except Exception:  # noqa: BLE001 - a backend may not implement it
        return ""


def cost_analysis(executable: LoadedExecutable) -> dict[str, object]:
    """XLA's cost analysis of the compiled program (`compiled.cost_analysis()`): numbers,
    flags and lists of numbers by name; {} where the backend gives none."""
    try:
        return dict(executable.cost_analysis() or {})
    except Exception:  # noqa: BLE001 - a backend may not implement it
        return {}


def arg_shardings(info: CompiledInfo, devices: Sequence[JaxlibDevice]
                  ) -> tuple[JaxSharding, ...]:
    """A jax sharding per parameter, to wrap shards into the arrays jaxlib executes on."""
    _jax, xc = jax_compat.jaxlib_extension(), jax_compat.xla_client()
    if info.param_shardings is None or len(devices) == 1:
        single = _jax.SingleDeviceSharding(devices[0])
        return tuple(single for _ in info.params)
    result = []
    for op in info.param_shardings:
        proto = xc.OpSharding()
        proto.ParseFromString(op)
        result.append(_jax.GSPMDSharding(tuple(devices), xc.HloSharding.from_proto(proto)))
    return tuple(result)


def result_handlers(info: CompiledInfo, devices: Sequence[JaxlibDevice]
                    ) -> list[ResultHandler] | None:
    """For a program on one device, per output, jaxlib's maker of its array (its aval and
    its device in the memory kind the program writes it to); None for a program on several
    devices, or one with an output that has no plain dtype (a token)."""
    if len(devices) != 1 or len(info.output_memory_kinds) != len(info.outputs):
        return None
    import jax

    _jax = jax_compat.jaxlib_extension()
    handlers = []
    for aval, kind in zip(info.outputs, info.output_memory_kinds):
        if aval.dtype.numpy is None:
            return None
        sharding = _jax.SingleDeviceSharding(devices[0], memory_kind=kind or None)
        handlers.append(jax_compat.result_handler(
            jax.core.ShapedArray(aval.shape, aval.dtype.numpy), sharding))
    return handlers
