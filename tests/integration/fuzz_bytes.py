"""The fuzzer's byte-level episodes (issue 37): the client-sent bytes that reach native code,
damaged as a buggy or hostile client would send them. Program bytecode (parsed, verified and
compiled first in the server's disposable process), compile options, and serialized
shardings. A refusal is always fine; nothing may die, hang or answer INTERNAL.
"""

from __future__ import annotations

import random

import numpy as np

from tests.integration.fuzz_programs import PROGRAMS
from tests.integration.fuzzer import Arr, Sess, State


def damage(rng: random.Random, data: bytes, start: int = 0) -> bytes:
    """`data` with a few bytes changed, cut short, or with bytes inserted, past `start`."""
    out = bytearray(data)
    case = rng.choice(("flip", "flip", "flip", "truncate", "insert", "zero_run"))
    if case == "truncate" and len(out) > start + 1:
        del out[rng.randrange(start + 1, len(out)):]
    elif case == "insert":
        at = rng.randrange(start, len(out) + 1)
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif case == "zero_run" and len(out) > start:
        at = rng.randrange(start, len(out))
        out[at:at + rng.randint(1, 16)] = b"\0" * len(out[at:at + 16])
    else:
        for _ in range(rng.randint(1, 4)):
            if len(out) > start:
                out[rng.randrange(start, len(out))] = rng.randrange(256)
    return bytes(out)


def _damaged_compile(s: Sess, what: str) -> None:
    """A real program compiled with its bytecode (`what` "program", damaged past the
    artifact's header) or its serialized XlaCompileOptions ("options") damaged."""
    rng = s.f.rng
    program = rng.choice([p for p in PROGRAMS if p.devices <= len(s.devices)])
    devices = s.program_devices(program)
    module = s.f.programs[program.name]
    options = s.compile_options(devices).SerializeToString()
    body = s.msg("CompileRequest")
    body.program.type_name = "xla::ifrt::XlaProgram"
    body.program.data = damage(rng, module, 24) if what == "program" else module
    body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
    body.compile_options.data = damage(rng, options) if what == "options" else options
    s.request("compile_request", body, expect="any",
              text=f"program {program.name} with damaged {what} bytes over {list(devices)}")
    s.settle()


def program_bytes(s: Sess) -> None:
    _damaged_compile(s, "program")


def options_bytes(s: Sess) -> None:
    _damaged_compile(s, "options")


def sharding_bytes(s: Sess) -> None:
    """An array made with its serialized sharding damaged: refused, or made as some
    sharding of its devices; either way its read is its value or a clean error."""
    rng = s.f.rng
    layout = rng.choice(("single", "tiled", "replicated"))
    count = 1 if layout == "single" else rng.choice([n for n in (2, 4) if n <= len(s.devices)])
    devices = tuple(rng.sample(s.devices, count))
    value = s.value((8,))
    sharding = s.sharding(layout, devices, "", 1)
    sharding.serialized_sharding.data = damage(rng, sharding.serialized_sharding.data)
    arr = s.add(Arr(s.new(), value, devices, layout, State.MAYBE, s.family()))
    hb = s.new()
    body = s.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=hb,
                 array_handle=arr.handle)
    body.dtype.kind = s.s["xla.ifrt.DTypeProto"].KIND_F32
    body.shape.dims.extend(value.shape)
    body.sharding.CopyFrom(sharding)
    s.store(hb, np.ascontiguousarray(value).tobytes())
    s.request("make_array_from_host_buffer_request", body, expect="any",
              text=f"an array with a damaged {layout} sharding over {list(devices)}",
              then=lambda r, ok: None if ok else setattr(arr, "state", State.GONE))
    s.settle()
    if arr.state is not State.GONE:
        s.read(arr)
        s.settle()
    s.end(arr)


EPISODES = {
    "bytes/program": (1.5, program_bytes),
    "bytes/options": (1, options_bytes),
    "bytes/sharding": (1, sharding_bytes),
}
