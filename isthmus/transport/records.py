"""Records the controller and its workers share besides the messages themselves: what a host
needs to compile a program, what a compile answers, a colocated Python program, and what a
profile records.

They travel inside messages (`messages.py`), registered in the fleet's codec by class name
and field order: renaming one or its fields changes the fleet's wire format.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from isthmus import dtypes
from isthmus.transport.messages import CODEC

# The IFRT `CustomCallProgram` type of jax's colocated Python functions.
COLOCATED_PROGRAM_TYPE = "jax_colocated_python_v0.0.1"


@CODEC.record  # travels in compile and load commands
@dataclasses.dataclass(frozen=True, slots=True)
class CompileRequest:
    """What a host needs to compile one program."""

    module: bytes  # StableHLO portable artifact or MLIR text
    compile_options: bytes  # serialized xla.CompileOptionsProto, already vetted
    device_ids: tuple[int, ...]  # global ids of the program's devices, replica-major
    replicas: int = 1  # the device assignment is device_ids as [replicas, computations]
    # A shared service's tenant: its executables are cached apart from other tenants'.
    namespace: str = ""
    # The executable the disposable process compiled (controller/vetting.py), for a host in the
    # controller's process to load instead of compiling again (empty: compile).
    executable: bytes = b""
    # The SHA-256 of the program without debug information, as the vetting process found it
    # (the hosts' caches name the program by it; empty: they parse the program for it).
    digest: bytes = b""
    # Its `main`'s signature, as the vetting process read it (None: the hosts parse the
    # program for it, a few ms a program).
    signature: Signature | None = None
    # As a plan of the controller's (`executables.ProgramPlan`): shared by every session that
    # compiles the same program, and compiled on the hosts.
    private: ClassVar[bool] = False
    on_hosts: ClassVar[bool] = True


@CODEC.record  # travels in compile replies
@dataclasses.dataclass(frozen=True, slots=True)
class Aval:
    """Global type of one program input or output."""

    dtype: dtypes.DType
    shape: tuple[int, ...]


@CODEC.record  # travels in compile commands, and from the vetting process
@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """What a program's `main` says of itself: its name, global parameter and output types,
    the parameters it donates, and the memory kind each parameter is read from (empty: none
    names one)."""

    name: str
    params: tuple[Aval, ...]
    outputs: tuple[Aval, ...]
    donated: tuple[int, ...]
    param_memory_kinds: tuple[str | None, ...]
    # Those of `donated` that only offer their buffer (`jax.buffer_donor`), which XLA aliases
    # to an output or not as it compiles; the rest name their output (`tf.aliasing_output`).
    donors: tuple[int, ...] = ()


@CODEC.record  # travels in compile replies
@dataclasses.dataclass(frozen=True, slots=True)
class CompiledInfo:
    """What the controller and the client ask about every executable, worked out at its
    compile. Its text and XLA's cost analysis are asked of a host only when the client asks
    for them (`commands.ProgramText`, `commands.CostAnalysis`): printing a large program
    costs a compile milliseconds that no client asks for."""

    name: str
    params: tuple[Aval, ...]
    outputs: tuple[Aval, ...]
    param_shardings: tuple[bytes, ...] | None  # xla.OpSharding per parameter; None: 1 device
    output_shardings: tuple[bytes, ...] | None  # xla.OpSharding per output; None: 1 device
    param_layouts: tuple[str, ...]  # e.g. "{1,0}"
    output_layouts: tuple[str, ...] | None  # None: unknown until the first call (a reshard)
    output_memory_kinds: tuple[str, ...]
    donated_inputs: tuple[int, ...]  # parameters the program may consume
    fingerprint: bytes | None
    memory_stats: dict[str, int]
    generated_code_bytes: int
    param_avals: tuple[object, ...] = ()  # jax ShapedArrays, for wrapping arguments
    # Per parameter, the memory kind the program reads it from (`mhlo.memory_kind`); None:
    # the device's default memory. Empty: no parameter names one.
    param_memory_kinds: tuple[str | None, ...] = ()
    # Why the backend gives no parameter (output) layouts, e.g. a program that takes (returns)
    # a token: XLA:CPU answers UNIMPLEMENTED, and jax then uses default layouts. "": none.
    param_layouts_error: str = ""
    output_layouts_error: str = ""

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)


@CODEC.record  # travels in compile and load commands
@dataclasses.dataclass(frozen=True, slots=True)
class ColocatedProgram:
    """A colocated Python function as a host needs it."""

    name: str
    text: bytes  # cloudpickle of (fun, in tree, in specs, out tree, out specs, devices)
    device_ids: tuple[int, ...]  # global ids of the call's devices
    inputs: tuple[tuple[int, ...], ...]  # per input: global device ids, in its sharding's order
    outputs: tuple[tuple[int, ...], ...]  # per output: likewise
    output_types: tuple[tuple[str, tuple[int, ...]], ...]  # per output: (dtype name, shape)
    private: ClassVar[bool] = True  # the session's own executable (`Controller.executable`)
    on_hosts: ClassVar[bool] = True  # loaded (unpickled) on the hosts of its devices


@CODEC.record  # travels in StartProfile
@dataclasses.dataclass(frozen=True, slots=True)
class TraceOptions:
    """What jax's profiler records (its `ProfileOptions`)."""

    host_tracer_level: int = 2  # host events (TraceMe): 0 none, 1 user, 2 + XLA ops, 3 all
    python_tracer_level: int = 0  # 1: every Python call of the process, too
    # Tracer-specific options, (name, bool | int | str) pairs, as jax's
    # `ProfileOptions.advanced_configuration` takes them.
    advanced: tuple[tuple[str, bool | int | str], ...] = ()
