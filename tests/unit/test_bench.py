"""The benchmark's own logic (its figures are never asserted: the machines are shared)."""

import asyncio

from bench.__main__ import threshold
from bench.scaling import programs_per_second


def test_threshold_is_where_the_ratio_stays_above_the_level():
    step_ms = [0.1, 1.0, 2.0, 4.0]
    assert threshold(step_ms, [0.2, 0.96, 0.9, 0.97]) == 4.0  # a dip later does not count
    assert threshold(step_ms, [0.2, 0.96, 0.97, 0.99]) == 1.0
    assert threshold(step_ms, [0.2, 0.5, 0.9, 0.94]) is None


def test_scaling_stand_ins_receive_every_program():
    # programs_per_second raises if a stand-in host missed a program's Execute.
    for hosts in (16, 64):
        assert asyncio.run(programs_per_second(hosts, 0.05)) > 0
