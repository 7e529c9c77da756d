"""Colocated Python programs: jax's `colocated_python` sends each function as a
`CustomCallProgram` of type `jax_colocated_python_v0.0.1` (cloudpickled code, the devices,
and the input and output specs). The front end reads the specs and hands the code, unread,
to the session; the hosts of the call unpickle it (`worker/colocated.py`).
"""

from __future__ import annotations

from isthmus import errors
from isthmus.controller.executables import Executable
from isthmus.frontend.message import Message
from isthmus.frontend.session import FrontendSession
from isthmus.transport.records import COLOCATED_PROGRAM_TYPE


def compile_custom_call(session: FrontendSession, program: Message) -> tuple[Executable, str]:
    """Starts a Compile of a CustomCallProgram: (the executable, its name). Its hosts
    unpickle it; the executable's `compiled` resolves when they have."""
    proto = session.schema["xla.ifrt.CustomCallProgramProto"]
    try:
        custom = proto.FromString(program.data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError
        raise errors.InvalidRequest("the CustomCallProgram does not parse.") from None
    if custom.type != COLOCATED_PROGRAM_TYPE:
        raise errors.Unimplemented(
            f"custom call programs of type {custom.type!r} are not supported; isthmus runs "
            f"{COLOCATED_PROGRAM_TYPE!r} (jax.experimental.colocated_python).")
    serdes = session.serdes
    inputs = [serdes.array_spec(s) for s in custom.input_specs]
    outputs = [serdes.array_spec(s) for s in custom.output_specs]
    device_ids = [int(d) for d in custom.devices.device_ids]
    if not device_ids:
        raise errors.InvalidRequest("the colocated function names no devices; specialize it "
                                    "with devices=... or pass it arrays.")
    executable = session.ctl.python.compile(
        custom.name, bytes(custom.serialized_program_text), device_ids,
        [(s.dtype, s.shape, s.sharding) for s in inputs],
        [(s.dtype, s.shape, s.sharding) for s in outputs])
    return executable, custom.name

