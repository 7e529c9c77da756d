"""An Orbax CheckpointManager round trip through a fresh process with pathwaysutils'
persistence handler (scripts/orbax_persistence.py): a state saved through one `isthmus run`
restores bit for bit, onto its own and onto other shardings, in another `isthmus run` (a
new client and a new fleet), with the workers writing and reading the shards; and the same
two runs on local jax (orbax's own handler) give the same checksums."""

import pytest

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("pathwaysutils")

from tests.workloads.harness import DEFAULT, assert_close, run_isthmus, run_local

SCRIPT = "orbax_persistence.py"
ENV = {"ENABLE_PATHWAYS_PERSISTENCE": "1"}


def _by_name(records):
    return {r["name"]: r["value"] for r in records}


def _round_trip(run, directory, **kwargs):
    saved = run(SCRIPT, ["save", str(directory)], env=ENV, **kwargs)
    restored = run(SCRIPT, ["restore", str(directory)], env=ENV, **kwargs)
    return saved, restored


@pytest.mark.workloads
def test_orbax_checkpoint_manager_round_trip_through_a_fresh_process(tmp_path):
    saved, restored = _round_trip(lambda *a, **k: run_isthmus(*a, fleet=DEFAULT, **k),
                                  tmp_path / "isthmus")
    # pathwaysutils' handler wrote the shards (one .npy per box, then meta.json), not
    # orbax's tensorstore; max_to_keep=2 left steps 1 and 2.
    assert sorted(p.name for p in (tmp_path / "isthmus").iterdir()) == ["1", "2"]
    w = tmp_path / "isthmus" / "2" / "default" / "params.w"
    assert (w / "meta.json").exists() and len(list(w.glob("shard-*.npy"))) == 8
    # The restore, in a new process on a new fleet, reads back what was saved, bit for bit.
    kept = _by_name(saved)
    for name, value in _by_name(restored).items():
        assert value == kept[name], (name, value, kept[name])
    assert set(_by_name(restored)) == {n for n in kept if not n.startswith("step0/")}

    local_saved, local_restored = _round_trip(run_local, tmp_path / "local")
    assert not list((tmp_path / "local").rglob("shard-*.npy"))  # orbax's own format
    assert_close(saved, local_saved, rtol=0, atol=0)
    assert_close(restored, local_restored, rtol=0, atol=0)
