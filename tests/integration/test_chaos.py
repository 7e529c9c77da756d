"""Chaos: an elastic training loop for a minute while a worker is killed every ~10 s and
the launcher restarts it (slow; `scripts/test -m slow`; `python -m bench.elastic --chaos 60`
prints the same run as a report)."""

import math

import pytest

from bench.elastic import chaos


@pytest.mark.slow
def test_elastic_training_survives_a_kill_every_ten_seconds():
    result = chaos(seconds=60.0, every=10.0)
    print(f"{len(result['kills'])} kills; {result['steps_run']} steps run for "
          f"{result['steps']}; {result['attempts']} attempts; worst relative loss difference "
          f"{result['worst_relative_loss_difference']:.2e}; memory MiB before "
          f"{result['memory_mib_before']} after {result['memory_mib_after']}")
    assert len(result["kills"]) >= 4, result["kills"]
    # No client crash (chaos() raises on a failed client), and every step was done.
    assert result["steps_logged"] == result["steps"]
    assert result["attempts"] >= 3
    # Every step's loss equals the undisturbed run's (steps redone on one slice add their
    # cross-slice reductions in another order).
    differing = sorted((int(step), loss, result["expected"][step])
                       for step, loss in result["losses"].items()
                       if step in result["expected"] and abs(loss - result["expected"][step])
                       > 1e-4 * abs(result["expected"][step]))
    assert result["worst_relative_loss_difference"] < 1e-4, (
        f"steps whose loss differs from the undisturbed run (step, loss, expected): "
        f"{differing[:20]}; kills at {[round(k['at_s'], 1) for k in result['kills']]} s; "
        f"client tail:\n{result['tail']}")
    # The controller's memory stays flat across the run (workers are fresh processes).
    before, after = (result["memory_mib_before"]["controller"],
                     result["memory_mib_after"]["controller"])
    assert math.isfinite(after) and after < before * 1.25 + 32, (before, after)
