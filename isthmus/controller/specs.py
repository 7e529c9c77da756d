"""A compiled program's parameter and output specs (`executables.ParamSpec`, `OutputSpec`),
worked out once, when the controller learns what the program is (`Executable.info`: at its
compile's answer, or at once when it was known before), and read by every run after
(`session_programs.py`)."""

from __future__ import annotations

from isthmus.controller import readahead
from isthmus.controller import sharding as sh
from isthmus.controller.executables import Executable, OutputSpec, ParamSpec
from isthmus.transport.records import CompiledInfo, CompileRequest


def work_out(executable: Executable, info: CompiledInfo) -> None:
    """Sets the executable's `info` and, for a program compiled on the hosts, its specs."""
    executable.info = info
    if isinstance(executable.request, CompileRequest):
        executable.param_specs = param_specs(executable, info)
        executable.output_specs = output_specs(executable, info)


def param_specs(executable: Executable, info: CompiledInfo) -> list[ParamSpec]:
    """Per parameter, the sharding its argument must have (None: the program does not say)
    and the memory kind it must be in."""
    device_ids = executable.device_ids
    default_kind = executable.devices[0].memory_kinds[0]
    kinds = info.param_memory_kinds
    specs: list[ParamSpec] = []
    for index in range(len(info.params)):
        if len(device_ids) == 1:
            sharding: sh.Sharding | None = sh.Sharding.single(device_ids[0])
        elif info.param_shardings is not None and index < len(info.param_shardings):
            sharding = sh.Sharding(sh.ShardingKind.HLO, device_ids, None,
                                   info.param_shardings[index])
        else:
            sharding = None
        specs.append(ParamSpec(sharding, (kinds[index] if index < len(kinds) else None)
                               or default_kind))
    return specs


def output_specs(executable: Executable, info: CompiledInfo) -> list[OutputSpec]:
    """Per output, what each run's array of it is and where; a small one's origin, for
    reading it ahead (`readahead.py`)."""
    device_ids = executable.device_ids
    specs: list[OutputSpec] = []
    for index, aval in enumerate(info.outputs):
        memory_kind = (info.output_memory_kinds[index]
                       if index < len(info.output_memory_kinds) else None)
        if info.output_shardings is None or len(device_ids) == 1:
            sharding = sh.Sharding(sh.ShardingKind.HLO, device_ids, memory_kind)
        else:
            sharding = sh.Sharding(sh.ShardingKind.HLO, device_ids, memory_kind,
                                   info.output_shardings[index])
        nbytes = sh.shard_nbytes(sharding, aval.shape, aval.dtype.itemsize)
        specs.append(OutputSpec(aval, sharding, nbytes, (executable.readahead, index)
                                if readahead.small(nbytes) else None))
    return specs
