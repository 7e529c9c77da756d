"""MaxText's pre-training trainer, unmodified, on a tiny synthetic-data model.

Runs `python -m maxtext.trainers.pre_train.train <base.yml> key=value ...` in this process
(runpy, so absl's `app.run(main)` runs as it does from the command line) and prints one
`WORKLOAD {"name": "loss step N", "value": X}` line per training step. The losses come from
MaxText's own per-step metrics: `metrics_file=` is its hook that writes each step's scalars
as JSON at full precision (the "completed step: N, ... loss: X" log line rounds to 3 places).

Through isthmus (JAX_PLATFORMS=proxy) it adds `enable_single_controller=true`, the way
MaxText runs under Pathways; on local jax it adds `skip_jax_distributed_system=true`.
Arguments to this script are more `key=value` overrides, appended after the defaults below
(MaxText takes the last one given), e.g. `steps=3` or `dcn_data_parallelism=2`.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

# A 2-layer llama2-style decoder small enough to compile and train in seconds on CPU.
TINY = [
    "hardware=cpu",
    "dataset_type=synthetic",
    "steps=5",
    "base_emb_dim=64",
    "base_num_decoder_layers=2",
    "base_mlp_dim=128",
    "base_num_query_heads=4",
    "base_num_kv_heads=4",
    "head_dim=16",
    "vocab_size=256",
    "max_target_length=64",
    "per_device_batch_size=1",
    "dtype=float32",
    # Nothing written or uploaded but the metrics file: no checkpoints, TensorBoard,
    # goodput, config dump or persistent compilation cache (~/jax_cache by default).
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "enable_goodput_recording=false",
    "monitor_goodput=false",
    "gcs_metrics=false",
    "save_config_to_gcs=false",
    "log_config=false",
    "jax_cache_dir=",
]


def run_trainer(argv: list[str]) -> None:
    """MaxText's trainer with `argv` (after the module name), in this process, the way
    `python -m maxtext.trainers.pre_train.train ...` runs it."""
    sys.argv = ["maxtext.trainers.pre_train.train", *argv]
    try:
        runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__",
                         alter_sys=True)
    except SystemExit as e:  # absl's app.run ends with sys.exit(main(argv))
        if e.code not in (None, 0):
            raise


def main() -> None:
    import maxtext

    base_yml = Path(maxtext.__file__).resolve().parent / "configs" / "base.yml"
    through_isthmus = os.environ.get("JAX_PLATFORMS", "") == "proxy"
    mode = ("enable_single_controller=true" if through_isthmus
            else "skip_jax_distributed_system=true")
    with tempfile.TemporaryDirectory(prefix="maxtext-wl-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        run_trainer([str(base_yml), "run_name=workload", f"base_output_directory={tmp}/out",
                     f"metrics_file={metrics}", *TINY, mode, *sys.argv[1:]])
        lines = metrics.read_text().splitlines() if metrics.exists() else []
    if not lines:
        raise SystemExit("maxtext_train: MaxText wrote no per-step metrics")
    for line in lines:
        record = json.loads(line)
        step = int(record["step"])
        print("WORKLOAD " + json.dumps({"name": f"loss step {step}",
                                        "value": record["learning/loss"]}), flush=True)


if __name__ == "__main__":
    main()
