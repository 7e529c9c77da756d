"""The internals of jax that isthmus uses, reached from this one module.

isthmus runs under jax, and part of what it needs has no public API: jaxlib's client module
and C++ extension (`jax._src.lib`), the PJRT plugin registry (`jax._src.xla_bridge`), the MLIR
context jax lowers in, its LAPACK set-up, the placement `jax.device_put` makes, its profiler
session, a sharding's device order, and the pickling of colocated Python functions.

Each is imported here when first asked for: importing this module imports no jax, so the
controller's modules that avoid jax still do. A jax that no longer has one raises
`JaxInternalMissing`, naming the internal and the installed version.
`tests/unit/test_jax_compat.py` touches every one on the installed jax.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "SUPPORTED", "JaxInternalMissing", "backends_are_initialized", "batched_device_put",
    "deserialize_colocated", "device_assignment", "discover_backends", "initialize_lapack",
    "jax_version", "jaxlib_extension", "make_ir_context", "make_tpu_client",
    "point_colocated_devices", "preload", "profiler_extension", "registered_backends",
    "tpu_chips", "xla_client",
]

SUPPORTED = "jax 0.10 to 0.12"  # the versions whose internals this module was checked against


class JaxInternalMissing(ImportError):
    """The installed jax lacks an internal that isthmus uses: it moved or was renamed."""


def jax_version() -> str:
    """The installed jax's version, read without importing jax."""
    from importlib import metadata

    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return "(none installed)"


def _missing(internal: str, cause: BaseException | None = None) -> JaxInternalMissing:
    why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return JaxInternalMissing(
        f"isthmus needs {internal}, which jax {jax_version()} no longer has{why}; install a "
        f"jax that isthmus supports ({SUPPORTED}), or an isthmus made for this jax.")


@contextlib.contextmanager
def _needs(internal: str) -> Iterator[None]:
    """A failed import or attribute lookup inside becomes `JaxInternalMissing(internal)`."""
    try:
        yield
    except (ImportError, AttributeError) as e:
        raise _missing(internal, e) from None


def _checked(module: Any, path: str, names: Sequence[str]) -> Any:
    """`module` (jax's `path`), once it is known to have each of `names`."""
    for name in names:
        if not hasattr(module, name):
            raise _missing(f"{path}.{name}")
    return module


# ---- jaxlib ----------------------------------------------------------------------------------

_XLA_CLIENT_NAMES = (
    "CompileOptions", "DeviceAssignment", "HloSharding", "OpSharding", "make_cpu_client",
    "make_c_api_client", "pjrt_plugin_initialized", "initialize_pjrt_plugin",
    "generate_pjrt_gpu_plugin_options")
_EXTENSION_NAMES = (
    "ArrayImpl", "DeviceList", "GSPMDSharding", "SingleDeviceSharding", "array_result_handler",
    "get_distributed_runtime_client", "get_distributed_runtime_service",
    "make_gloo_tcp_collectives")


@functools.cache
def xla_client() -> Any:
    """jaxlib's `xla_client` (`jax._src.lib.xla_client`): compile options, `OpSharding` and
    `HloSharding`, device assignments, and making CPU and plugin (CUDA) clients."""
    with _needs("jax._src.lib.xla_client"):
        from jax._src.lib import xla_client as module
    return _checked(module, "jax._src.lib.xla_client", _XLA_CLIENT_NAMES)


@functools.cache
def jaxlib_extension() -> Any:
    """jaxlib's C++ extension (`jax._src.lib._jax`): device lists, shardings, arrays made over
    given shards, and the distributed runtime (service, client, gloo collectives)."""
    with _needs("jax._src.lib._jax"):
        from jax._src.lib import _jax as module
    return _checked(module, "jax._src.lib._jax", _EXTENSION_NAMES)


def result_handler(aval: Any, sharding: Any) -> Any:
    """jaxlib's maker of a committed array of `aval` on `sharding` from an executable's
    output buffers (`ExecuteResults.consume_with_handlers`), as jax's own dispatch makes its
    outputs: nothing built again per call."""
    make = jaxlib_extension().array_result_handler
    try:
        return make(aval, sharding, committed=True, _skip_checks=True)
    except TypeError:  # jaxlib >= 0.11 takes no _skip_checks
        return make(aval, sharding, committed=True)


@functools.cache
def profiler_extension() -> Any:
    """jaxlib's profiler (`jax._src.lib._profiler`): `ProfileOptions` and `ProfilerSession`,
    the session `jax.profiler.start_trace` starts, without its export."""
    with _needs("jax._src.lib._profiler"):
        from jax._src.lib import _profiler as module
    return _checked(module, "jax._src.lib._profiler", ("ProfileOptions", "ProfilerSession"))


# ---- jax's backends ---------------------------------------------------------------------------

def backends_are_initialized() -> bool:
    """Whether jax has made its backends in this process (after which none can be added)."""
    with _needs("jax._src.xla_bridge.backends_are_initialized"):
        from jax._src import xla_bridge

        initialized = xla_bridge.backends_are_initialized
    return initialized()


def discover_backends() -> frozenset[str]:
    """Registers the installed PJRT plugins (`jax_plugins.*`, e.g. the CUDA plugin) with jax,
    as jax does when it makes its backends; returns the names of every backend jax can make."""
    with _needs("jax._src.xla_bridge._discover_and_register_pjrt_plugins"):
        from jax._src import xla_bridge

        discover = xla_bridge._discover_and_register_pjrt_plugins
    discover()
    return registered_backends()


def make_tpu_client() -> Any:
    """A client of the TPU chips this process may use, made as jax makes its own
    (`xla_bridge.make_tpu_client` with libtpu's library), while jax's own backends stay on
    the CPU (JAX_PLATFORMS=cpu: the chip's lock is taken once, by this client)."""
    with _needs("jax._src.xla_bridge.make_tpu_client"):
        from jax._src import xla_bridge
        from jax._src.cloud_tpu_init import get_tpu_library_path

        return xla_bridge.make_tpu_client(get_tpu_library_path(), {})


def tpu_chips() -> int:
    """The TPU chips attached to this machine (PCI), counted as jax counts them, without
    touching libtpu."""
    with _needs("jax._src.hardware_utils.num_available_tpu_chips_and_device_id"):
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])


def registered_backends() -> frozenset[str]:
    """The names of the backends registered with jax so far (by its own modules, by plugins
    it found, by `register_backend_factory`), without looking for more plugins."""
    with _needs("jax._src.xla_bridge._backend_factories"):
        from jax._src import xla_bridge

        return frozenset(xla_bridge._backend_factories)


# ---- lowering, linear algebra, placement ------------------------------------------------------

@functools.cache
def _mlir() -> Any:
    with _needs("jax._src.interpreters.mlir"):
        from jax._src.interpreters import mlir
    return _checked(mlir, "jax._src.interpreters.mlir", ("make_ir_context",))


@functools.cache
def _linalg() -> Any:
    with _needs("jax._src.lax.linalg"):
        from jax._src.lax import linalg
    return _checked(linalg, "jax._src.lax.linalg", ("initialize_lapack",))


def make_ir_context() -> Any:
    """An MLIR context with jax's dialects registered, as jax lowers in."""
    return _mlir().make_ir_context()


def initialize_lapack() -> None:
    """Points jaxlib's LAPACK kernels at their functions (scipy's), as jax does while it
    lowers; a process that only runs programs must do it itself or call null pointers."""
    _linalg().initialize_lapack()


def preload() -> None:
    """Imports the internals a worker needs, ahead of time (they are slow to import)."""
    _mlir()
    _linalg()


@functools.cache
def batched_device_put() -> Callable[..., Any]:
    """`jax._src.interpreters.pxla.batched_device_put(aval, sharding, values, devices)`: what
    `jax.device_put` calls for numpy data, without its argument handling."""
    with _needs("jax._src.interpreters.pxla.batched_device_put"):
        from jax._src.interpreters import pxla

        return pxla.batched_device_put


def device_assignment(sharding: Any) -> Sequence[Any]:
    """A jax sharding's devices in its own order (`Sharding._device_assignment`; the public
    `device_set` has no order)."""
    with _needs("jax.sharding.Sharding._device_assignment"):
        return sharding._device_assignment


# ---- colocated Python -------------------------------------------------------------------------

_COLOCATED = "jax.experimental.colocated_python.serialization"
_COLOCATED_NAMES = (
    "_deserialize", "_get_cpu_device_map", "_make_reduce_func_with_common_obj",
    "_reduce_mesh", "_unreduce_mesh", "_reduce_device_list", "_unreduce_device_list",
    "_reduce_single_device_sharding", "_unreduce_single_device_sharding")


@functools.cache
def _colocated_serialization() -> Any:
    with _needs(_COLOCATED):
        from jax.experimental.colocated_python import serialization
    return _checked(serialization, _COLOCATED, _COLOCATED_NAMES)


def deserialize_colocated(text: bytes) -> Any:
    """Unpickles what jax's colocated Python sends (`serialization._deserialize`): the
    function, its input tree and specs, its output tree and specs, and its devices."""
    return _colocated_serialization()._deserialize(text)


def point_colocated_devices(by_id: Callable[[], dict[int, Any]],
                            global_id: Callable[[Any], int]) -> None:
    """Makes jax's colocated-Python pickling name devices by the ids these give: unpickling
    looks a device id up in `by_id()`, and a pickled mesh, device list or single-device
    sharding names each device by `global_id(device)`. Once per process: later calls change
    nothing, so both functions should read state their caller keeps up to date."""
    s = _colocated_serialization()
    if getattr(s, "_isthmus_patched", False):
        return
    wrap = s._make_reduce_func_with_common_obj

    @wrap
    def reduce_mesh(mesh: Any) -> tuple[Callable[..., Any], Any]:
        import numpy as np

        ids = np.vectorize(global_id, otypes=[int])(mesh.devices)
        return s._unreduce_mesh, (ids, mesh.axis_names, mesh.axis_types)

    @wrap
    def reduce_device_list(device_list: Any) -> tuple[Callable[..., Any], Any]:
        return s._unreduce_device_list, ([global_id(d) for d in device_list],)

    @wrap
    def reduce_single_device_sharding(sharding: Any) -> tuple[Callable[..., Any], Any]:
        (device,) = sharding.device_set
        return s._unreduce_single_device_sharding, (global_id(device), sharding.memory_kind)

    s._get_cpu_device_map = by_id
    s._reduce_mesh = reduce_mesh
    s._reduce_device_list = reduce_device_list
    s._reduce_single_device_sharding = reduce_single_device_sharding
    s._isthmus_patched = True
