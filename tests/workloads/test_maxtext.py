"""MaxText's pre-training trainer, unmodified, through isthmus and on local jax.

`scripts/maxtext_train.py` trains a tiny 2-layer decoder on synthetic data for 5 steps and
prints each step's loss; the losses through `isthmus run` must match those of local jax on
8 CPU devices, step for step. MaxText and its imports live in their own environment
(see the script's docstring for what it runs); without MaxText this module is skipped.
"""

from __future__ import annotations

import pytest

pytest.importorskip("maxtext")

from tests.workloads.harness import TWO_SLICES, assert_close, run_isthmus, run_local

SCRIPT = "maxtext_train.py"
STEPS = 5


def _losses(records: list[dict]) -> list[dict]:
    assert [r["name"] for r in records] == [f"loss step {i}" for i in range(STEPS)], records
    return records


@pytest.mark.workloads
@pytest.mark.timeout(600)
def test_maxtext_default_fleet():
    """1 slice x 2 hosts x 4 devices; MaxText's default mesh (fsdp over all 8 devices)."""
    got = _losses(run_isthmus(SCRIPT, timeout=300))
    want = _losses(run_local(SCRIPT, timeout=300))
    assert_close(got, want, rtol=1e-6)


@pytest.mark.workloads
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_maxtext_two_slices():
    """2 slices x 1 host x 4 devices, data parallel across the slices (dcn_data_parallelism=2);
    locally the same (data 2, fsdp 4) mesh comes from ici_data_parallelism=2, since local
    CPU devices are all one slice."""
    got = _losses(run_isthmus(SCRIPT, ["dcn_data_parallelism=2"], fleet=TWO_SLICES,
                              timeout=300))
    want = _losses(run_local(SCRIPT, ["ici_data_parallelism=2"], timeout=300))
    assert_close(got, want, rtol=1e-6)
