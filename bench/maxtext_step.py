"""One MaxText training run for bench/maxtext_peer.py: the workloads tier's model, timed.

    python bench/maxtext_step.py STEPS [key=value ...]

Trains the workloads tier's tiny 2-layer decoder (tests/workloads/scripts/maxtext_train.py's
config, synthetic data) with MaxText's own trainer for STEPS steps and prints one JSON line:
each step's time as MaxText measures it (`perf/step_time_seconds` of its metrics file, the
wall time from one step's dispatch to the next's), its loss, and the tokens of a step.

How it runs is the environment's: through isthmus (JAX_PLATFORMS=proxy) it adds
`enable_single_controller=true`, as MaxText runs under Pathways; as one process of a
multi-controller job (ISTHMUS_BENCH_PEER, bench/peer.py) it joins `jax.distributed` with
gloo first, and MaxText finds it joined, each process feeding its own part of the batch;
otherwise it is local jax in one process.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "workloads" / "scripts"))
sys.path.insert(0, str(ROOT))

from maxtext_train import TINY, run_trainer  # noqa: E402  (the workloads tier's model)


def main() -> None:
    import jax
    import maxtext

    from bench.dp_loop import join_peer

    steps = int(sys.argv[1])
    processes, process_id = join_peer()
    base_yml = Path(maxtext.__file__).resolve().parent / "configs" / "base.yml"
    if os.environ.get("JAX_PLATFORMS", "") == "proxy":
        mode = ["enable_single_controller=true"]
    elif processes > 1:
        mode = []  # MaxText sees jax.distributed joined and leaves it as it is
    else:
        mode = ["skip_jax_distributed_system=true"]
    with tempfile.TemporaryDirectory(prefix="maxtext-bench-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        run_trainer([str(base_yml), "run_name=bench", f"base_output_directory={tmp}/out",
                     f"metrics_file={metrics}", *TINY, f"steps={steps}", *mode, *sys.argv[2:]])
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    if process_id != 0:
        return
    records.sort(key=lambda r: int(r["step"]))
    devices = jax.device_count()
    config = dict(item.split("=", 1) for item in TINY)
    tokens = (devices * int(config["per_device_batch_size"])
              * int(config["max_target_length"]))
    print(json.dumps({"step_s": [r["perf/step_time_seconds"] for r in records],
                      "loss": [r["learning/loss"] for r in records],
                      "tokens_per_step": tokens, "devices": devices,
                      "processes": processes}), flush=True)


if __name__ == "__main__":
    main()
