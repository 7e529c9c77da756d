"""Compile time of one program in a fresh client process (prints JSON).

Run twice against one server: the first run compiles cold, the second finds the program in
the server's compilation cache (jax's own in-process cache is empty in a new process).
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    def step(x, w):
        for _ in range(12):
            x = jnp.tanh(x @ w + jnp.sin(x))
        return jnp.sum(x * 0.123456)

    x = np.ones((256, 256), np.float32)
    lowered = jax.jit(step).lower(x, x)
    start = time.perf_counter()
    lowered.compile()
    print(json.dumps({"compile_ms": (time.perf_counter() - start) * 1e3}))


if __name__ == "__main__":
    main()
