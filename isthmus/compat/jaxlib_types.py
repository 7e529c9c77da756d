"""Names for the jaxlib objects isthmus holds, which have no typed API that stays put across
the jax versions isthmus supports (`compat.jax.SUPPORTED`).

jaxlib's classes move between `xla_client`, `_jax` and `jax._src` from one release to the
next, their stubs change with them, and isthmus reaches most of them through `compat/jax.py`,
whose functions return `Any`. Each name here is `Any` to the type checker: it says what the
value is, so that a signature reads as what it takes, and a jax whose types hold still can
make one of them a real type here, in one place. Importing this module imports no jax.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = [
    "CompileOptions", "CpuCollectives", "DeviceList", "DistributedClient", "JaxArray",
    "JaxAval", "JaxSharding", "JaxlibClient", "JaxlibDevice", "LoadedExecutable",
    "MlirContext", "MlirModule", "MlirType", "OpSharding", "ProfilerSession", "ResultHandler",
    "ShardedToken",
]

# A PjRt client (jaxlib's CPU client, the CUDA plugin's, libtpu's): its devices, compiling,
# loading and (de)serializing executables.
JaxlibClient: TypeAlias = Any
# One device of a `JaxlibClient` (`client.devices()`); hashable, compared by identity.
JaxlibDevice: TypeAlias = Any
# A jax array on one device (jaxlib's ArrayImpl), or a stand-in that answers what a host
# asks of one (a simulated run's output, a colocated call's placeholder); `jax.Array` itself
# would refuse the stand-ins.
JaxArray: TypeAlias = Any
# A jax sharding (SingleDeviceSharding, GSPMDSharding) over `JaxlibDevice`s.
JaxSharding: TypeAlias = Any
# jax's abstract value of an array (`jax.core.ShapedArray`), which jaxlib's array makers take.
JaxAval: TypeAlias = Any
# A program compiled and loaded on a client's devices (PjRt's LoadedExecutable).
LoadedExecutable: TypeAlias = Any
# `xla_client.CompileOptions`, parsed from the bytes the client sent.
CompileOptions: TypeAlias = Any
# `xla_client.OpSharding`: a sharding as XLA's protobuf (an executable's parameters').
OpSharding: TypeAlias = Any
# jaxlib's `DeviceList`: the devices a program is compiled for, in its order.
DeviceList: TypeAlias = Any
# jaxlib's maker of an output's array from its buffer (`compat.jax.result_handler`).
ResultHandler: TypeAlias = Any
# The token of a run over several devices (`execute_sharded(with_tokens=True)`).
ShardedToken: TypeAlias = Any
# The distributed runtime's client: this process's link to a collective group's coordinator.
DistributedClient: TypeAlias = Any
# gloo's collectives of a CPU client that spans processes.
CpuCollectives: TypeAlias = Any
# A started jaxlib profiler session (`compat.jax.profiler_extension`).
ProfilerSession: TypeAlias = Any
# An MLIR context with jax's dialects (`compat.jax.make_ir_context`), a module parsed in it,
# and a type of its values (jaxlib's MLIR bindings).
MlirContext: TypeAlias = Any
MlirModule: TypeAlias = Any
MlirType: TypeAlias = Any
