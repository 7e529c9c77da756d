"""The vetting process reads a program's signature in the parse it does anyway, and the hosts
compile with it instead of parsing the program again (a few ms a program, most of it in
MLIR's parser)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isthmus.controller.vetting import Vetted, _pack, _unpack, vet_program
from isthmus.transport.records import CompileRequest
from isthmus.worker import programs


def _program() -> bytes:
    def step(w, x):
        return w - 0.1 * jnp.tanh(x.T @ x @ w), jnp.sum(x).astype(jnp.bfloat16)

    w, x = np.ones((8, 8), np.float32), np.ones((4, 8), np.float32)
    return jax.jit(step, donate_argnums=0).lower(w, x).as_text().encode()


def test_the_vetted_signature_is_the_one_a_host_would_parse():
    vetted, compiled = vet_program(_program())
    assert not compiled and vetted.signature is not None
    assert vetted.signature == programs.parse_signature(vetted.module)
    assert vetted.signature.donated == (0,)
    assert [a.dtype.mlir for a in vetted.signature.outputs] == ["f32", "bf16"]
    assert _unpack(_pack(vetted)) == vetted
    remembered = Vetted(vetted.module, vetted.digest)  # across a restart: no signature
    assert _unpack(_pack(remembered)) == remembered


def test_a_program_without_main_is_refused_by_the_vetting_process():
    text = b"module @m { func.func public @other() { return } }"
    with pytest.raises(Exception, match="no `main` function"):
        vet_program(text)


def test_a_host_compiles_with_the_vetted_signature_without_parsing_again(monkeypatch):
    vetted, _ = vet_program(_program())
    devices = jax.devices("cpu")[:1]
    from isthmus.compat import jax as jax_compat

    compile_options = jax_compat.xla_client().CompileOptions().SerializeAsString()
    request = CompileRequest(vetted.module, compile_options, (devices[0].id,))
    _, parsed = programs.compile_program(devices[0].client, devices, request)

    def no_parse(module):
        raise AssertionError("parsed the program again")

    monkeypatch.setattr(programs, "parse_signature", no_parse)
    _, given = programs.compile_program(devices[0].client, devices, CompileRequest(
        vetted.module, compile_options, (devices[0].id,), signature=vetted.signature))
    assert given == parsed
