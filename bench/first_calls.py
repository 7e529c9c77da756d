"""What a new program costs the first time it is called: N distinct tiny programs (a 16 x 16
matmul with a different constant each), each one's first call (trace, lower, compile, run,
fetch) and its second, with jax's own compile events summed. Run it on local jax and through
isthmus; the difference of the medians is isthmus's cost per new program.

    python bench/first_calls.py [N]                                    # local jax
    isthmus run --platform tpu --devices 1 -- python bench/first_calls.py [N]   # embedded

Prints one JSON line: backend, n, the medians of the first and second calls (ms) and the
sum of each jax compile event (ms; `backend_compile_duration` through isthmus is the client's
whole compile: its request, the server's vetting and compile, and the answer).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import monitoring

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    events: collections.defaultdict[str, float] = collections.defaultdict(float)

    def listen(event: str, duration: float, **_: object) -> None:
        events[event] += duration

    monitoring.register_event_duration_secs_listener(listen)
    x = jax.device_put(np.ones((16, 16), np.float32))
    np.asarray(jax.jit(lambda a: a + 1)(x))
    first, second = [], []
    for i in range(n):
        f = jax.jit(lambda a, c=float(i): (a @ a) * c + jnp.tanh(a))
        start = time.perf_counter()
        np.asarray(f(x))
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        np.asarray(f(x))
        second.append(time.perf_counter() - start)
    print(json.dumps({"backend": jax.default_backend(), "n": n,
                      "first_ms": round(statistics.median(first) * 1e3, 2),
                      "second_ms": round(statistics.median(second) * 1e3, 2),
                      "events_ms": {k: round(v * 1e3, 1) for k, v in events.items()}}))


if __name__ == "__main__":
    main()
