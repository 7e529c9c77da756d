"""Compile requests and questions about loaded executables.

Compile options come from the client and are not trusted: the server keeps its own XLA debug
options and takes only an allowlist of the client's (optimization choices jax sets on
purpose); paths, dump directories, GPU library locations, fake device counts and flag
overrides stay the server's business.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.controller.executables import Executable
from isthmus.frontend import layouts
from isthmus.frontend.colocated import compile_custom_call
from isthmus.frontend.message import Message
from isthmus.frontend.plugins import compile_plugin
from isthmus.frontend.session import FrontendSession
from isthmus.protocol.schema import Schema
from isthmus.transport.records import CompiledInfo, CompileRequest

logger = logging.getLogger(__name__)

XLA_PROGRAM = "xla::ifrt::XlaProgram"
XLA_COMPILE_OPTIONS = "xla::ifrt::XlaCompileOptions"
CUSTOM_CALL_PROGRAM = "xla::ifrt::CustomCallProgram"
PLUGIN_PROGRAM = "xla::ifrt::PluginProgram"

# DebugOptions fields a client may choose; all others keep the server's values.
ALLOWED_DEBUG_OPTIONS = frozenset({
    "xla_backend_optimization_level",
    "xla_llvm_disable_expensive_passes",
    "xla_test_all_input_layouts",
    "xla_disable_hlo_passes",
    "xla_enable_hlo_passes_only",
    "xla_detailed_logging",
    "xla_enable_dumping",
    "xla_cpu_enable_fast_math",
    "xla_cpu_enable_fast_min_max",
    "xla_cpu_fast_math_honor_nans",
    "xla_cpu_fast_math_honor_infs",
    "xla_cpu_fast_math_honor_division",
    "xla_cpu_fast_math_honor_functions",
    "xla_gpu_enable_fast_min_max",
    "xla_allow_excess_precision",
    "xla_step_marker_location",
    "xla_embed_ir_in_executable",
})


class CompileOptionsVetter:
    """Turns a client's XlaCompileOptions into options the server is willing to use.

    Compiler options (jax's `compiler_options=`, carried as XLA option overrides) are checked
    the way XLA checks them; the allowlisted ones take effect, the others are dropped.
    """

    def __init__(self, schema: Schema) -> None:
        xc = jax_compat.xla_client()  # the server's own defaults
        self._xla_options = schema["xla.ifrt.XlaCompileOptionsProto"]
        self._options = schema["xla.CompileOptionsProto"]
        defaults = self._options.FromString(xc.CompileOptions().SerializeAsString())
        self._default_debug = defaults.executable_build_options.debug_options

    def _vet_overrides(self, options: Message) -> None:
        overrides = options.env_option_overrides
        for key in sorted(overrides):
            error = _override_error(self._default_debug, key, overrides[key])
            if error is not None:
                raise error
        dropped = [k for k in overrides if k not in ALLOWED_DEBUG_OPTIONS]
        if dropped:
            logger.info("ignoring compiler options the server does not allow: %s", dropped)
        for key in dropped:
            del overrides[key]

    def vet(self, serialized: Message, fleet_devices: Sequence[int]
            ) -> tuple[bytes, tuple[int, ...], int]:
        """(vetted CompileOptionsProto bytes, device ids of the assignment, replica count).

        Options without a device assignment get one, as XLA's server derives it: the first
        device for portable executables, `device_ordinal`, or the default assignment."""
        if serialized.type_name != XLA_COMPILE_OPTIONS:
            raise errors.Unimplemented(
                f"compile options of type {serialized.type_name!r} are not supported; "
                "isthmus compiles XLA programs with XlaCompileOptions.")
        try:
            options = self._xla_options.FromString(serialized.data).compile_options
        except Exception:  # noqa: BLE001
            raise errors.InvalidRequest("the compile options do not parse.") from None
        build = options.executable_build_options
        assignment = build.device_assignment
        if not assignment.computation_devices:
            _default_assignment(options, fleet_devices)
        replicas = assignment.replica_count
        if replicas < 1 or assignment.computation_count not in (
                0, len(assignment.computation_devices)):
            raise errors.InvalidRequest(
                f"the device assignment has replica_count {replicas} and computation_count "
                f"{assignment.computation_count} for {len(assignment.computation_devices)} "
                "computations; give at least one replica and one list per computation.")
        device_ids: list[int] = []
        for replica in range(replicas):
            for computation in assignment.computation_devices:
                if replica >= len(computation.replica_device_ids):
                    raise errors.InvalidRequest("the device assignment is ragged.")
                device_ids.append(int(computation.replica_device_ids[replica]))
        _vet_build_options(options, len(device_ids), replicas)
        client_debug = build.debug_options
        debug = type(self._default_debug)()
        debug.CopyFrom(self._default_debug)
        for field, value in client_debug.ListFields():
            if field.name in ALLOWED_DEBUG_OPTIONS:
                getattr(debug, field.name)  # exists in the server's schema
                if hasattr(value, "extend"):  # a repeated field
                    getattr(debug, field.name)[:] = value
                else:
                    setattr(debug, field.name, value)
        build.debug_options.CopyFrom(debug)
        self._vet_overrides(options)
        # Deterministic bytes: they key the executable caches (maps otherwise vary).
        return options.SerializeToString(deterministic=True), tuple(device_ids), replicas


# Build options jax never sets and XLA trusts (jaxlib aborts on a bad `device_ordinal`; a
# `result_layout`, `run_backend_only` or memory size the program does not fit crashes or
# miscompiles): the server's defaults stand. The device assignment, written above from the
# client's, is the one source of devices.
_DROPPED_BUILD_OPTIONS = ("result_layout", "comp_envs", "run_backend_only",
                          "device_memory_size", "slice_size", "gpu_topology", "fdo_profile")
_DROPPED_OPTIONS = ("serialized_multi_slice_config", "target_config", "compiler_variant",
                    "allow_in_place_mlir_modification")


def _vet_build_options(options: Message, devices: int, replicas: int) -> None:
    """Checks the client's build options against its device assignment; drops the fields
    that name devices or layouts another way. Raises InvalidRequest naming the field."""
    build = options.executable_build_options
    build.device_ordinal = -1  # the assignment names the devices
    for message, fields in ((build, _DROPPED_BUILD_OPTIONS), (options, _DROPPED_OPTIONS)):
        known = message.DESCRIPTOR.fields_by_name  # jaxlib versions differ in their fields
        for field in fields:
            if field in known:
                message.ClearField(field)
    if options.argument_layouts:
        raise errors.Unimplemented(
            "compile_options.argument_layouts (custom argument layouts) are not supported by "
            "isthmus; use the default layouts.")
    if options.parameter_is_tupled_arguments:
        raise errors.Unimplemented(
            "compile_options.parameter_is_tupled_arguments is not supported by isthmus; pass "
            "the arguments untupled.")
    partitions = devices // max(replicas, 1)
    for field, expected in (("num_replicas", replicas), ("num_partitions", partitions)):
        value = getattr(build, field)
        if value not in (0, expected):
            raise errors.InvalidRequest(
                f"compile_options.executable_build_options.{field} is {value} but the device "
                f"assignment has {expected}; make them agree (or leave {field} unset).")
    if "process_index" in build.DESCRIPTOR.fields_by_name and not (
            0 <= build.process_index < max(build.process_count, 1)):
        raise errors.InvalidRequest(
            f"compile_options.executable_build_options.process_index is "
            f"{build.process_index}, outside 0..{max(build.process_count, 1) - 1}; leave it "
            "unset (the server places the program on its hosts).")
    known = build.DESCRIPTOR.fields_by_name
    mesh = list(build.auto_spmd_partitioning_mesh_shape) if (
        "auto_spmd_partitioning_mesh_shape" in known) else []
    ids = list(build.auto_spmd_partitioning_mesh_ids) if (
        "auto_spmd_partitioning_mesh_ids" in known) else []
    if mesh or ids:
        size = 1
        for d in mesh:
            size *= d
        if any(d <= 0 for d in mesh) or size != devices or sorted(ids) != list(range(devices)):
            raise errors.InvalidRequest(
                f"compile_options.executable_build_options.auto_spmd_partitioning_mesh_shape "
                f"{mesh} and mesh_ids {ids} must cover the program's {devices} devices once "
                "each.")


def _default_assignment(options: Message, fleet_devices: Sequence[int]) -> None:
    build = options.executable_build_options
    if options.compile_portable_executable:
        devices = [[fleet_devices[0]]]
    elif 0 <= build.device_ordinal < len(fleet_devices):  # XLA writes -1 when unset
        devices = [[fleet_devices[build.device_ordinal]]]
    else:
        replicas, partitions = max(build.num_replicas, 1), max(build.num_partitions, 1)
        if replicas * partitions > len(fleet_devices):
            raise errors.InvalidRequest(
                f"the program asks for {replicas} replicas x {partitions} partitions, more "
                f"than the {len(fleet_devices)} devices of this server.")
        devices = [[fleet_devices[c * replicas + r] for r in range(replicas)]
                   for c in range(partitions)]
    assignment = build.device_assignment
    assignment.replica_count = len(devices[0])
    assignment.computation_count = len(devices)
    for replica_ids in devices:
        assignment.computation_devices.add().replica_device_ids.extend(replica_ids)


def _override_error(debug: Message, key: str, value: Message) -> errors.IsthmusError | None:
    """XLA's own complaint about one compiler option (jax's `compiler_options`), if any."""
    field = debug.DESCRIPTOR.fields_by_name.get(key)
    if field is None:
        return errors.InvalidRequest(f"No such compile option: '{key}'")
    kind = value.WhichOneof("value")
    if field.type == field.TYPE_BOOL and not (
            kind == "bool_field" or kind == "string_field" and value.string_field.lower() in (
                "true", "false")):
        shown = getattr(value, kind) if kind else ""
        return errors.InvalidRequest(f"value {shown!r} is not a valid bool value.")
    return None


def compile_program(session: FrontendSession, request: Message,
                    response: Message) -> Awaitable[None]:
    body = request.compile_request
    program = body.program
    if program.type_name == CUSTOM_CALL_PROGRAM:
        executable, name = compile_custom_call(session, program)
        return _answer(session, executable, response.compile_response, name)
    if program.type_name == PLUGIN_PROGRAM:
        executable = compile_plugin(session, program)
        return _answer(session, executable, response.compile_response)
    if program.type_name != XLA_PROGRAM:
        raise errors.Unimplemented(
            f"program type {program.type_name!r} is not supported; isthmus compiles "
            f"{XLA_PROGRAM} (StableHLO from jax), {CUSTOM_CALL_PROGRAM} (colocated Python) and "
            f"{PLUGIN_PROGRAM} (pathwaysutils' persistence).")
    if body.host_callbacks:
        raise errors.Unimplemented(
            "programs with host callbacks (jax.debug.print, pure_callback, io_callback) are not "
            "supported by isthmus; remove the callback or run it outside jit.")
    options, device_ids, replicas = session.vetter.vet(
        body.compile_options, [d.id for d in session.fleet.devices])
    module = bytes(program.data)

    async def compile_vetted() -> None:
        # Parsed (and on CPU compiled) in a disposable process first.
        vetted = await session.ctl.core.controller.vet(module, options, len(device_ids))
        executable = session.ctl.programs.compile(CompileRequest(
            vetted.module, options, device_ids, replicas, executable=vetted.executable,
            digest=vetted.digest, signature=vetted.signature))
        await _answer(session, executable, response.compile_response)

    return compile_vetted()


async def _answer(session: FrontendSession, executable: Executable, out: Message,
                  name: str | None = None) -> None:
    """Fills a CompileResponse once the executable is loaded on its hosts."""
    compiled = executable.compiled
    assert compiled is not None  # the controller starts its compile as it makes it
    try:
        info = await compiled
    except errors.IsthmusError:
        session.ctl.programs.release(executable)
        raise
    handle = session.new_handle()
    session.executables[handle] = executable
    out.loaded_executable_handle = handle
    out.name = name or info.name
    out.num_devices = len(executable.devices)
    out.device_ids.extend(d.id for d in executable.devices)
    out.addressable_device_ids.extend(d.id for d in executable.devices)
    if info.fingerprint is not None:
        out.fingerprint_value = info.fingerprint
    else:
        out.fingerprint_error.code = int(errors.Code.UNIMPLEMENTED)
        out.fingerprint_error.message = "no fingerprint for this executable"

    async def ready() -> None:
        return None

    out.ready_future_handle = session.add_future(None, ready)


def _layouts(text_layouts: tuple[str, ...], out: Message) -> None:
    for text in text_layouts:  # with their tiles: a TPU's are tiled
        layouts.fill(text, out.layouts.add())


def _info(executable: Executable) -> CompiledInfo:
    # An executable enters the session's table once compiled (`_answer`): its info is known.
    assert executable.info is not None
    return executable.info


def metadata(session: FrontendSession, request: Message, response: Message) -> None:
    executable = session.executable(request.loaded_executable_metadata_request
                                    .loaded_executable_handle)
    info = _info(executable)
    out = response.loaded_executable_metadata_response
    if info.param_shardings is not None:
        out.parameter_shardings.SetInParent()
        for op in info.param_shardings:
            out.parameter_shardings.shardings.add().ParseFromString(op)
    if info.output_shardings is not None:
        out.output_shardings.SetInParent()
        for op in info.output_shardings:
            out.output_shardings.shardings.add().ParseFromString(op)
    if info.param_layouts_error:
        out.parameter_layouts_error.code = int(errors.Code.UNIMPLEMENTED)
        out.parameter_layouts_error.message = info.param_layouts_error
    else:
        out.parameter_layouts_list.SetInParent()
        _layouts(info.param_layouts, out.parameter_layouts_list)
    if info.output_layouts_error:
        out.output_layouts_error.code = int(errors.Code.UNIMPLEMENTED)
        out.output_layouts_error.message = info.output_layouts_error
    elif info.output_layouts is None:  # known at the first call (pathwaysutils' reshard)
        out.output_layouts_error.code = int(errors.Code.UNIMPLEMENTED)
        out.output_layouts_error.message = "output layouts are known at the first call"
    else:
        out.output_layouts_list.SetInParent()
        _layouts(info.output_layouts, out.output_layouts_list)
    kinds = out.output_memory_kinds.memory_kind_lists.add()
    kinds.memory_kinds.extend(info.output_memory_kinds)
    out.donated_input_indices.SetInParent()
    out.donated_input_indices.donated_input_indices.extend(info.donated_inputs)
    if info.memory_stats:
        stats = out.compiled_memory_stats
        for field, value in info.memory_stats.items():
            if field in stats.DESCRIPTOR.fields_by_name:
                setattr(stats, field, value)
    else:
        out.compiled_memory_stats_error.code = int(errors.Code.UNIMPLEMENTED)
        out.compiled_memory_stats_error.message = "no memory statistics"
    out.size_of_generated_code_in_bytes = info.generated_code_bytes


def cost_analysis(session: FrontendSession, request: Message,
                  response: Message) -> Awaitable[None] | None:
    # Errors go inside the response: the client cannot survive a top-level error here.
    result = response.loaded_executable_cost_analysis_response
    try:
        executable = session.executable(
            request.loaded_executable_cost_analysis_request.loaded_executable_handle)
    except errors.IsthmusError as e:
        result.status.code = int(e.code)
        result.status.message = e.message
        return None
    out = result.attributes
    out.SetInParent()
    asked = session.ctl.core.controller.cost_analysis(executable)
    if asked is None:  # no program compiled: nothing to analyse
        return None

    async def answer() -> None:
        try:
            analysis = await asked
        except errors.IsthmusError as e:
            result.status.code = int(e.code)
            result.status.message = e.message
            return
        _attributes(analysis, out)

    return answer()


def _attributes(analysis: dict[str, object], out: Message) -> None:
    for key, value in sorted(analysis.items()):
        entry = out.attributes[key]
        if isinstance(value, bool):
            entry.bool_value = value
        elif isinstance(value, int):
            entry.int64_value = value
        elif isinstance(value, float):
            entry.float_value = value
        elif isinstance(value, (list, tuple)):
            entry.int64_list_value.elements.extend(int(v) for v in value)
        else:
            entry.string_value = str(value).encode()


def program_text(session: FrontendSession, request: Message,
                 response: Message) -> Awaitable[None] | None:
    out = response.loaded_executable_human_readable_program_text_response
    try:
        executable = session.executable(
            request.loaded_executable_human_readable_program_text_request
            .loaded_executable_handle)
    except errors.IsthmusError as e:
        out.status.code = int(e.code)
        out.status.message = e.message
        return None
    asked = session.ctl.core.controller.program_text(executable)
    if asked is None:  # no program compiled: no text
        return None

    async def answer() -> None:
        try:
            out.human_readable_program_text = await asked
        except errors.IsthmusError as e:
            out.status.code = int(e.code)
            out.status.message = e.message

    return answer()


def delete_executable(session: FrontendSession, request: Message, response: Message) -> None:
    handle = request.loaded_executable_delete_request.loaded_executable_handle
    executable = session.executable(handle)
    session.deleted_executables.add(handle)
    session.ctl.programs.release(executable)

    async def done() -> None:
        return None

    response.loaded_executable_delete_response.future_handle = session.add_future(None, done)


def executable_is_deleted(session: FrontendSession, request: Message, response: Message) -> None:
    handle = request.loaded_executable_is_deleted_request.loaded_executable_handle
    session.executable(handle)
    response.loaded_executable_is_deleted_response.is_deleted = (
        handle in session.deleted_executables)


def destruct_executable(session: FrontendSession, request: Message, response: Message) -> None:
    handle = request.loaded_executable_destruct_request.loaded_executable_handle
    value = session.executables.pop(handle, None)
    if value is not None and not isinstance(value, errors.IsthmusError) \
            and handle not in session.deleted_executables:
        session.ctl.programs.release(value)
    session.deleted_executables.discard(handle)
    response.loaded_executable_destruct_response.SetInParent()
