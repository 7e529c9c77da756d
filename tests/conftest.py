"""Shared test configuration.

The test process itself runs local jax on 8 CPU devices (for expected values); servers and
clients run in subprocesses.
"""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every server a test starts checks its records after each request (`isthmus up --validate`).
os.environ.setdefault("ISTHMUS_VALIDATE", "1")
# NumPy's and SciPy's OpenBLAS each start a thread per further core at import, which spins
# for ~0.1 s of CPU before it sleeps: in each of the suite's thousands of processes (a fork
# starts them again), about 3% of the suite's CPU on 2 cores, for matrices of a few numbers.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The `one_environment` tests that the oldest environment runs (the others: the newest).
ONE_ENVIRONMENT_OLDEST = ("tests/integration/test_shared",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `one_environment` run once when `scripts/test` runs both environments (it
    says which one this is in ISTHMUS_TEST_ENV, and which it runs in ISTHMUS_TEST_ENVS).
    What they test is the server's own code, the same whichever jax the environment has: a
    shared service, the commands' refusals and waits, TLS and tokens between fleet members,
    HTTP/2 attacks, the metrics, the deployment under Slurm. A shared service's
    (`ONE_ENVIRONMENT_OLDEST`) run in the oldest, the others in the newest: the newest alone
    runs the workloads tier, and so the two runs end about together on 2 cores. A test in
    which the client's or the workers' jax does the work runs in both."""
    # The workloads tier first: its tests are the suite's longest (a minute each on 2 cores),
    # and a run split over processes by file (`scripts/test`) ends badly when they come last.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/workloads/"))
    env = os.environ.get("ISTHMUS_TEST_ENV")
    both = set(os.environ.get("ISTHMUS_TEST_ENVS", "").split()) == {"oldest", "newest"}
    if not both or env not in ("oldest", "newest"):
        return  # one environment (or plain pytest): it runs them all
    for item in items:
        if item.get_closest_marker("one_environment") is None:
            continue
        runs_in = "oldest" if item.nodeid.startswith(ONE_ENVIRONMENT_OLDEST) else "newest"
        if runs_in != env:
            item.add_marker(pytest.mark.skip(
                reason=f"runs in the {runs_in} environment only (scripts/test)"))
