"""Shared test configuration.

The test process itself runs local jax on 8 CPU devices (for expected values); servers and
clients run in subprocesses.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
