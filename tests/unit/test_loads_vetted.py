"""Which servers have their hosts load the vetting process's trial compile (`head.loads_vetted`):
the embedded backend on CPU and a fleet, never a shared service (that process parses every
tenant's bytes: its machine code is not to run on another tenant's workers) nor simulated
hosts."""

import pytest

from isthmus.controller.manager import FleetSpec
from isthmus.head import HeadConfig, SharedConfig, loads_vetted
from isthmus.worker.platforms import Platform


@pytest.mark.parametrize("config, expected", [
    (HeadConfig(), True),
    (HeadConfig(platform=Platform("cuda")), False),
    (HeadConfig(fleet=FleetSpec(2, 1, 1)), True),
    (HeadConfig(fleet=FleetSpec(2, 1, 1), shared=SharedConfig("tenants.toml")), False),
    (HeadConfig(fleet=FleetSpec(2, 1, 1), platform=Platform(simulate_flops=1e12)), False),
], ids=["embedded", "embedded-cuda", "fleet", "shared-service", "simulated"])
def test_who_loads_the_vetted_executable(config, expected):
    assert loads_vetted(config) is expected
