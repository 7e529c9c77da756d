"""Every jax internal that isthmus reaches (`isthmus/compat/jax.py`), touched on the installed
jax: an upgrade that moves one fails here, with the internal and the jax version named."""

import subprocess
import sys

import numpy as np
import pytest

from isthmus.compat import jax as jax_compat


def _colocated_round_trip():
    """A mesh and a sharding pickled by jax's colocated Python with the device ids isthmus
    gives, and unpickled on the devices it gives back."""
    import jax
    from jax.experimental.colocated_python import serialization
    from jax.sharding import Mesh, SingleDeviceSharding

    from isthmus.worker.colocated import use_devices  # jax_compat.point_colocated_devices

    devices = jax.devices("cpu")[:1]
    use_devices({70 + i: d for i, d in enumerate(devices)})
    mesh = Mesh(np.array(devices), ("x",))
    sharding = SingleDeviceSharding(devices[0])
    text = serialization._serialize((mesh, sharding))  # as the client pickles
    back_mesh, back_sharding = jax_compat.deserialize_colocated(text)
    assert list(back_mesh.devices.flat) == devices and back_sharding == sharding


def _xla_client():
    xc = jax_compat.xla_client()
    options = xc.CompileOptions()
    assert xc.CompileOptions.ParseFromString(options.SerializeAsString()) is not None
    proto = xc.OpSharding()
    proto.type = xc.OpSharding.Type.REPLICATED
    assert xc.HloSharding.from_proto(proto).is_replicated()
    assert xc.DeviceAssignment.create(np.array([[0]], dtype=np.int64)) is not None
    for name in ("pjrt_plugin_initialized", "initialize_pjrt_plugin",
                 "generate_pjrt_gpu_plugin_options", "make_c_api_client"):
        assert callable(getattr(xc, name))
    client = xc.make_cpu_client(asynchronous=True, num_devices=2)
    assert len(client.devices()) == 2


def _jaxlib_extension():
    import jax

    ext = jax_compat.jaxlib_extension()
    device = jax.devices("cpu")[0]
    assert list(ext.DeviceList((device,))) == [device]
    single = ext.SingleDeviceSharding(device)
    shard = jax.device_put(np.arange(3, dtype=np.float32), single)
    aval = jax.core.ShapedArray((3,), np.float32)
    array = ext.ArrayImpl(aval, single, [shard], True, True)
    assert np.array_equal(np.asarray(array), np.arange(3, dtype=np.float32))
    xc = jax_compat.xla_client()
    proto = xc.OpSharding()
    proto.type = xc.OpSharding.Type.REPLICATED
    assert ext.GSPMDSharding((device,), xc.HloSharding.from_proto(proto)).is_fully_replicated
    for name in ("get_distributed_runtime_client", "get_distributed_runtime_service",
                 "make_gloo_tcp_collectives"):
        assert callable(getattr(ext, name))


def _profiler_extension():
    ext = jax_compat.profiler_extension()
    options = ext.ProfileOptions()
    options.host_tracer_level = 1
    options.python_tracer_level = 0
    options.advanced_configuration = {}
    assert callable(ext.ProfilerSession)


def _backends_are_initialized():
    assert jax_compat.backends_are_initialized() in (True, False)


def _discover_backends():
    assert "cpu" in jax_compat.discover_backends()


def _registered_backends():
    assert "cpu" in jax_compat.registered_backends()


def _make_ir_context():
    from jaxlib.mlir import ir

    with jax_compat.make_ir_context():
        module = ir.Module.parse("func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {"
                                 " return %x : tensor<2xf32> }")
    assert "func.func" in str(module)


def _initialize_lapack():
    jax_compat.initialize_lapack()


def _preload():
    jax_compat.preload()


def _batched_device_put():
    import jax
    from jax.sharding import SingleDeviceSharding

    device = jax.devices("cpu")[0]
    value = np.arange(4, dtype=np.int32)
    put = jax_compat.batched_device_put()
    array = put(jax.core.ShapedArray(value.shape, value.dtype), SingleDeviceSharding(device),
                [value], [device])
    assert np.array_equal(np.asarray(array), value)


def _device_assignment():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices("cpu")[:1]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    assert list(jax_compat.device_assignment(sharding)) == devices


# Each public name of the compat module, and how it is touched.
def _make_tpu_client():
    """Without chips the internals are still found: libtpu's path, the client maker."""
    from jax._src import xla_bridge
    from jax._src.cloud_tpu_init import get_tpu_library_path

    assert callable(xla_bridge.make_tpu_client) and callable(get_tpu_library_path)
    if jax_compat.tpu_chips() == 0:
        return
    assert jax_compat.make_tpu_client().platform == "tpu"  # pragma: no cover - TPU only


def _tpu_chips():
    assert jax_compat.tpu_chips() >= 0


TOUCH = {
    "backends_are_initialized": _backends_are_initialized,
    "batched_device_put": _batched_device_put,
    "deserialize_colocated": _colocated_round_trip,
    "device_assignment": _device_assignment,
    "discover_backends": _discover_backends,
    "initialize_lapack": _initialize_lapack,
    "jaxlib_extension": _jaxlib_extension,
    "make_ir_context": _make_ir_context,
    "make_tpu_client": _make_tpu_client,
    "point_colocated_devices": _colocated_round_trip,
    "preload": _preload,
    "profiler_extension": _profiler_extension,
    "registered_backends": _registered_backends,
    "tpu_chips": _tpu_chips,
    "xla_client": _xla_client,
}
NOT_INTERNALS = {"SUPPORTED", "JaxInternalMissing", "jax_version"}


def test_every_internal_the_compat_module_offers_is_touched_here():
    assert set(TOUCH) | NOT_INTERNALS == set(jax_compat.__all__)


@pytest.mark.parametrize("name", sorted(TOUCH))
def test_the_installed_jax_has_the_internal(name):
    try:
        TOUCH[name]()
    except jax_compat.JaxInternalMissing as e:
        pytest.fail(f"{name}: {e}")
    except Exception as e:  # noqa: BLE001 - there, but it changed: name the upgrade
        pytest.fail(f"jax {jax_compat.jax_version()} changed an internal isthmus uses "
                    f"(isthmus.compat.jax.{name}): {type(e).__name__}: {e}")


def test_a_missing_internal_names_itself_and_the_jax_version(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.delattr(xla_bridge, "_discover_and_register_pjrt_plugins")
    with pytest.raises(jax_compat.JaxInternalMissing) as raised:
        jax_compat.discover_backends()
    message = str(raised.value)
    assert ("isthmus needs jax._src.xla_bridge._discover_and_register_pjrt_plugins, which jax "
            f"{jax_compat.jax_version()} no longer has") in message
    assert jax_compat.SUPPORTED in message


def test_a_module_without_a_name_isthmus_uses_is_refused_by_name(monkeypatch):
    from jax._src.lib import _profiler

    monkeypatch.delattr(_profiler, "ProfilerSession")
    jax_compat.profiler_extension.cache_clear()
    try:
        with pytest.raises(jax_compat.JaxInternalMissing,
                           match=r"jax\._src\.lib\._profiler\.ProfilerSession, which jax "):
            jax_compat.profiler_extension()
    finally:
        jax_compat.profiler_extension.cache_clear()


def test_importing_the_compat_module_imports_no_jax():
    code = ("import sys; import isthmus.compat.jax; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
