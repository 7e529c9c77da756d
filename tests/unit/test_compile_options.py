"""Client compile options are vetted, not applied blindly."""

import pytest

from isthmus import errors
from isthmus.frontend.programs import CompileOptionsVetter
from isthmus.protocol.schema import schema


def _serialized(build_fields=None, debug_fields=None, assignment=((0, 1),)):
    s = schema()
    options = s["xla.ifrt.XlaCompileOptionsProto"]()
    compile_options = options.compile_options
    build = compile_options.executable_build_options
    for name, value in (build_fields or {}).items():
        setattr(build, name, value)
    for name, value in (debug_fields or {}).items():
        setattr(build.debug_options, name, value)
    if assignment:
        build.device_assignment.replica_count = len(assignment[0])
        build.device_assignment.computation_count = len(assignment)
        for replicas in assignment:
            build.device_assignment.computation_devices.add(replica_device_ids=list(replicas))
    compile_options.env_option_overrides["xla_dump_to"].string_field = "/tmp/x"
    out = s["xla.ifrt.Serialized"](type_name="xla::ifrt::XlaCompileOptions",
                                  data=options.SerializeToString())
    return out


def _vet(serialized, devices=range(8)):
    data, device_ids, _ = CompileOptionsVetter(schema()).vet(serialized, list(devices))
    return schema()["xla.CompileOptionsProto"].FromString(data), device_ids


def test_dangerous_debug_options_are_reset_and_allowed_ones_kept():
    options, device_ids = _vet(_serialized(debug_fields={
        "xla_dump_to": "/etc", "xla_gpu_cuda_data_dir": "/evil",
        "xla_force_host_platform_device_count": 512, "xla_backend_optimization_level": 0}))
    debug = options.executable_build_options.debug_options
    assert debug.xla_dump_to == "" and debug.xla_gpu_cuda_data_dir != "/evil"
    assert debug.xla_force_host_platform_device_count != 512
    assert debug.xla_backend_optimization_level == 0  # jax sets this on purpose
    assert not options.env_option_overrides  # xla_dump_to is not for clients to set
    assert device_ids == (0, 1)


def test_compiler_options_are_checked_like_xla_and_allowlisted():
    s = schema()
    serialized = _serialized()
    options = s["xla.ifrt.XlaCompileOptionsProto"].FromString(serialized.data)
    overrides = options.compile_options.env_option_overrides
    overrides["xla_embed_ir_in_executable"].bool_field = True
    serialized.data = options.SerializeToString()
    vetted, _ = _vet(serialized)
    assert list(vetted.env_option_overrides) == ["xla_embed_ir_in_executable"]
    overrides["invalid_key"].string_field = "x"
    serialized.data = options.SerializeToString()
    with pytest.raises(errors.InvalidRequest, match="No such compile option: 'invalid_key'"):
        _vet(serialized)
    del overrides["invalid_key"]
    overrides["xla_embed_ir_in_executable"].string_field = "invalid_value"
    serialized.data = options.SerializeToString()
    with pytest.raises(errors.InvalidRequest, match="is not a valid bool value"):
        _vet(serialized)


def test_device_assignment_order_and_defaults():
    _, ids = _vet(_serialized(assignment=((5, 6), (7, 4))))  # 2 computations x 2 replicas
    assert ids == (5, 7, 6, 4)  # replica-major, as XLA flattens it
    _, ids = _vet(_serialized(build_fields={"num_partitions": 4, "device_ordinal": -1},
                              assignment=None))
    assert ids == (0, 1, 2, 3)
    _, ids = _vet(_serialized(build_fields={"device_ordinal": 6}, assignment=None))
    assert ids == (6,)
    with pytest.raises(errors.InvalidRequest, match="more than"):
        _vet(_serialized(build_fields={"num_partitions": 16, "device_ordinal": -1},
                         assignment=None))


def test_unknown_option_types_are_refused():
    bad = schema()["xla.ifrt.Serialized"](type_name="xla::ifrt::Mystery", data=b"")
    with pytest.raises(errors.Unimplemented):
        _vet(bad)
