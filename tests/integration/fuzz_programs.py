"""The programs the fuzzer compiles: real jax functions lowered to StableHLO portable
artifacts, each with its sharding per argument and output and a numpy twin.

Lowering with shardings over 2 or 4 devices needs a jax with that many local devices, which
the test process may not have (its jax may already be initialized with one CPU device), so
`lowered()` lowers them once in a child Python with 4 CPU devices and caches the bytes.

Layouts name the stock client's sharding forms over a program's device list:
`single` (one device), `tiled` (dimension 0 split over the devices, in list order),
`replicated` (a full copy per device) and `grid` (a 2x2 split of a matrix over 4 devices).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class Arg:
    shape: tuple[int, ...]  # global shape (all programs take and give f32)
    layout: str  # single | tiled | replicated | grid, over the program's devices


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    name: str
    devices: int  # partitions: the length of its device assignment
    args: tuple[Arg, ...]
    out: Arg
    donate: tuple[int, ...]  # donated argument positions
    fn: Callable[..., np.ndarray]  # the numpy twin, on global values
    jax_fn: str  # the jax function's source, lowered in the child


V8, M44 = (8,), (4, 4)
PROGRAMS: tuple[Program, ...] = (
    Program("add1", 1, (Arg(V8, "single"),), Arg(V8, "single"), (),
            lambda x: x + np.float32(1), "lambda x: x + 1"),
    Program("add1_donate", 1, (Arg(V8, "single"),), Arg(V8, "single"), (0,),
            lambda x: x + np.float32(1), "lambda x: x + 1"),
    Program("addxy_donate", 1, (Arg(V8, "single"), Arg(V8, "single")), Arg(V8, "single"),
            (0,), lambda x, y: x + y, "lambda x, y: x + y"),
    Program("axpy2", 2, (Arg(V8, "tiled"), Arg(V8, "replicated")), Arg(V8, "tiled"), (),
            lambda x, y: np.float32(2) * x + y, "lambda x, y: 2 * x + y"),
    Program("add4", 4, (Arg(V8, "tiled"), Arg(V8, "replicated")), Arg(V8, "tiled"), (),
            lambda x, y: x + y, "lambda x, y: x + y"),
    Program("gather4", 4, (Arg(V8, "tiled"),), Arg(V8, "replicated"), (),
            lambda x: x * np.float32(3), "lambda x: x * 3"),
    Program("spread4", 4, (Arg(V8, "replicated"),), Arg(V8, "tiled"), (),
            lambda x: x - np.float32(2), "lambda x: x - 2"),
    Program("addxy4_donate", 4, (Arg(V8, "tiled"), Arg(V8, "tiled")), Arg(V8, "tiled"), (0,),
            lambda x, y: x + y, "lambda x, y: x + y"),
    Program("grid4_donate", 4, (Arg(M44, "grid"),), Arg(M44, "grid"), (0,),
            lambda x: np.float32(2) * x - np.float32(1), "lambda x: 2 * x - 1"),
)
BY_NAME = {p.name: p for p in PROGRAMS}

_CHILD = r'''
import base64, json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax._src.lib import _jax
from jaxlib.mlir.dialects import stablehlo

def sharding(n, layout):
    if n == 1:
        return None
    if layout == "grid":
        return NamedSharding(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b")),
                             P("a", "b"))
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    return NamedSharding(mesh, P("d") if layout == "tiled" else P())

out = {}
for name, n, args, res, donate, src in json.loads(sys.stdin.read()):
    kw = {"donate_argnums": tuple(donate)}
    if n > 1:
        kw["in_shardings"] = tuple(sharding(n, layout) for _, layout in args)
        kw["out_shardings"] = sharding(n, res[1])
    lowered = jax.jit(eval(src), **kw).lower(
        *(np.zeros(shape, np.float32) for shape, _ in args))
    text = str(lowered.compiler_ir("stablehlo"))
    out[name] = base64.b64encode(_jax.mlir.serialize_portable_artifact(
        text, stablehlo.get_current_version())).decode()
print(json.dumps(out))
'''


@functools.cache
def lowered(timeout: float = 120.0) -> dict[str, bytes]:
    """Program name -> serialized StableHLO portable artifact (lowered once per process)."""
    spec = [(p.name, p.devices, [(a.shape, a.layout) for a in p.args],
             (p.out.shape, p.out.layout), p.donate, p.jax_fn) for p in PROGRAMS]
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_BACKEND_TARGET")}
    result = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(spec),
                            capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode:
        raise RuntimeError(f"lowering the fuzzer's programs failed:\n{result.stderr[-4000:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return {name: base64.b64decode(text) for name, text in data.items()}
