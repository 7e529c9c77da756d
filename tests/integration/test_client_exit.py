"""Issue 47: the stock client's exit through isthmus is a normal exit, every time.

jaxlib 0.10.2's client, destroyed at interpreter exit, cancels its session with array and
executable destructions still unanswered, and could then free its session's work queue from
one of that queue's own threads: SIGABRT ("Mutex corrupt" after "Failed to destroy
LoadedExecutable") after the script's work was done. isthmus's client plugin keeps the client
alive at exit (isthmus/_bootstrap/jax_plugins/isthmus_proxy.py), so none of that runs. Each
backend: 8 clients, 2 at a time, each with executables and a few hundred arrays alive at its
exit, must exit 0 with none of the marks of a cancelled session in their output.
"""

from __future__ import annotations

import concurrent.futures
import os

from isthmus.testing import run_python

CLIENT = """
import jax, jax.numpy as jnp, numpy as np
functions = [jax.jit(lambda x, k=k: jnp.tanh(x * k) + k) for k in range(10)]
x = jnp.arange(64, dtype=jnp.float32)
arrays = [f(x) for f in functions for _ in range(20)]  # alive at exit, with their programs
total = float(sum(a.sum() for a in arrays[::20]))
expected = float(sum((np.tanh(np.arange(64, dtype=np.float32) * k) + k).sum()
                     for k in range(10)))
assert abs(total - expected) < 1e-2 * abs(expected), (total, expected)
print("done", len(arrays))
"""

# What a client that cancelled its session on its way out writes (at TF_CPP_MIN_LOG_LEVEL=1).
MARKS = ("IFRT proxy server disconnected", "Failed to destroy", "Mutex corrupt",
         "Connection to IFRT proxy server was terminated", "Batched response from ifrt proxy")


def test_the_clients_exit_is_a_normal_exit(server):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="1")

    def one(_):
        return run_python(CLIENT, server.address, timeout=120, env=env)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, range(8)))
    for result in results:
        assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
        assert result.stdout.split() == ["done", "200"], result.stdout
        marks = [mark for mark in MARKS if mark in result.stderr]
        assert not marks, f"{marks}:\n{result.stderr[-3000:]}"
