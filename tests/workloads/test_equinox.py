"""Equinox's autoparallelism example (scripts/equinox_parallel.py): an MLP trained with a
data-sharded batch under `eqx.filter_jit`, with and without donation, gives the same losses
through isthmus as on local jax."""

import pytest

pytest.importorskip("equinox")
pytest.importorskip("optax")

from tests.workloads.harness import (
    DEFAULT,
    EMBEDDED,
    assert_close,
    run_isthmus,
    run_local,
)

SCRIPT = "equinox_parallel.py"


@pytest.mark.workloads
@pytest.mark.parametrize("donate", ["keep", "donate"])
def test_equinox_parallelism_on_the_default_fleet(donate):
    want = run_local(SCRIPT, [donate])
    got = run_isthmus(SCRIPT, [donate], fleet=DEFAULT)
    assert want[-1] == {"name": "devices", "value": 8}
    # The gradient's mean over the batch is reduced across the two hosts: the last bits
    # may differ from one process's order (about 1e-7 relative).
    assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.workloads
def test_equinox_parallelism_with_donation_on_the_embedded_backend():
    want = run_local(SCRIPT, ["donate"])
    got = run_isthmus(SCRIPT, ["donate"], fleet=EMBEDDED)
    assert_close(got, want, rtol=1e-6, atol=0)
