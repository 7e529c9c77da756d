"""Tunix's GRPO learner (google-tunix), unmodified, through isthmus on two slices: the trainer
on one slice's mesh and the rollout engine on the other's, against local jax with 8 CPU
devices (`scripts/tunix_grpo.py`)."""

from __future__ import annotations

import pytest

pytest.importorskip("tunix")

from tests.workloads.harness import TWO_SLICES, assert_close, run_isthmus, run_local

SCRIPT = "tunix_grpo.py"


@pytest.mark.workloads
@pytest.mark.timeout(900)
def test_tunix_grpo_two_slices_matches_local():
    want = run_local(SCRIPT, timeout=300)
    got = run_isthmus(SCRIPT, fleet=TWO_SLICES, timeout=420)
    names = [r["name"] for r in want]
    assert "actor/loss" in names and "rewards/sum" in names and "param_sum" in names
    assert {r["name"]: r["value"] for r in want}["separate_rollout_mesh"] is True
    # The same XLA CPU programs on the same shardings: the results have been bit for bit
    # the same. The rollout samples (temperature 0.9), so a difference in the logits would
    # show as a different token and a jump in the rewards, not a drift a looser tolerance
    # would absorb; 1e-5 leaves room only for a reduction order changed by the fleet's shape.
    assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.workloads
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tunix_grpo_on_one_slice_matches_local():
    """The default fleet (one slice of 2 hosts x 4 devices): trainer and rollout meshes
    are both on it, across the two worker processes."""
    want = run_local(SCRIPT, timeout=300)
    got = run_isthmus(SCRIPT, timeout=420)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
