"""The parts of a small round trip, p50 over N calls each, on local jax or through isthmus.

    python bench/round_trip.py [N] [PART,...]
    isthmus run [--platform tpu] [--devices 1] -- python bench/round_trip.py [N] [PART,...]

Parts (all by default), each on a float32[64] and `jax.jit(lambda a: a * 2)`:

- `jit_block`: a call and `block_until_ready` (one wait of the client: CheckValueReady);
- `jit_fetch`: a call and `np.asarray` of its result (a fetch of a result still being
  computed: the stock client waits for CopyToHostBuffer's answer, then for its lookup);
- `fetch_ready`: `np.asarray` of a result already computed (the same two waits, and the
  device's own copy to the host);
- `put_block`: `jax.device_put` and `block_until_ready`.

Prints one JSON object: each part's p50 in ms, and its start and end (`PART_t0`, `PART_t1`,
wall-clock seconds), so that a timeline of the server (bench/phases) can be cut to one part.
bench/echo_floor.py measures what the platform itself charges for a round trip.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

PARTS = ("jit_block", "jit_fetch", "fetch_ready", "put_block")


def p50_ms(call: Callable[[object], object], n: int,
           prepare: Callable[[], object] = lambda: None) -> float:
    """The median time of `call`, given what `prepare` made, untimed, before each."""
    times = []
    for _ in range(n):
        made = prepare()
        start = time.perf_counter()
        call(made)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def measure(n: int, parts: tuple[str, ...] = PARTS) -> dict[str, float]:
    import jax

    double = jax.jit(lambda a: a * 2)
    host = np.arange(64, dtype=np.float32)
    x = jax.device_put(host)
    np.asarray(double(x))  # compiled, and each path taken once

    def computed() -> object:
        y = double(x)
        y.block_until_ready()
        return y

    calls: dict[str, tuple[Callable[[object], object], Callable[[], object]]] = {
        "jit_block": (lambda _: double(x).block_until_ready(), lambda: None),
        "jit_fetch": (lambda _: np.asarray(double(x)), lambda: None),
        "fetch_ready": (np.asarray, computed),
        "put_block": (lambda _: jax.device_put(host).block_until_ready(), lambda: None),
    }
    out: dict[str, float] = {}
    for part in parts:
        if part not in calls:
            raise SystemExit(f"round_trip.py: no part {part!r}; the parts are {', '.join(PARTS)}")
        call, prepare = calls[part]
        p50_ms(call, min(n, 20), prepare)  # warm
        out[f"{part}_t0"] = time.time()
        out[part] = p50_ms(call, n, prepare)
        out[f"{part}_t1"] = time.time()
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    parts = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else PARTS
    print(json.dumps(measure(n, parts)), flush=True)


if __name__ == "__main__":
    main()
