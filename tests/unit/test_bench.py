"""The benchmark's own logic (its figures are never asserted: the machines are shared)."""

import asyncio

import pytest

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


def test_shared_service_section_names_every_figure_and_column():
    from bench.shared import TARGETS, report

    row = {"alone_us": 400.0, "three_us": 1000.0, "ratio": 0.4, "ratio_worst": 0.38,
           "aggregate_speedup": 1.2,
           "cpu_us_per_program_alone": {"client": 130.0, "controller": 200.0},
           "cpu_us_per_program_three": {"client": 150.0, "controller": 210.0},
           "cores_busy_three": 1.9, "cores_other_three": 0.05}
    results = {"fleet": "3x1x1",
               "handover": {"total_ms": 220.0, "release_to_grant_ms": 8.0,
                            "grant_to_result_ms": 212.0, "connect_ms": 70.0,
                            "first_program_ms": 140.0, "repeats": 5},
               "grant": {"grant_ms": 25.0, "release_ms": 6.0, "repeats": 10},
               "tenants": {"isthmus shared": row, "local jax": row}}
    text = "\n".join(report(results))
    for figure in ("220.0 ms", "8.0 ms", "70.0 ms", "140.0 ms", "25.0 ms",
                   f"<= {TARGETS['handover_ms']:.0f}", f"<= {TARGETS['grant_ms']:.0f}",
                   "controller 200/210", "0.40"):
        assert figure in text, figure
    assert sum(line.lstrip().startswith(("isthmus shared", "local jax"))
               for line in text.splitlines()) == 2


def test_data_parallel_section_shows_each_feed_as_a_ratio_of_the_peer():
    from bench.__main__ import DP_PIECES, dp_report

    row = dict.fromkeys(DP_PIECES, 1.0)
    table = {"local jax 8 devices": dict(row), "multi-controller 2x4": dict(row, steps_per_s=40.0),
             "isthmus fleet 1x2x4": dict(row, steps_per_s=38.0, **{"/ peer": 0.95}),
             "fleet, colocated loader": dict(row, steps_per_s=42.0, **{"/ peer": 1.05})}
    text = dp_report(table)
    for figure in ("multi-controller 2x4", "40.00", "isthmus fleet 1x2x4 / multi-controller, "
                   "steps/s: 0.95x", "fleet, colocated loader / multi-controller, steps/s: 1.05x"):
        assert figure in text, figure


def test_cpu_accounting_is_per_step_between_two_run_lengths():
    from bench.dp_cpu import STEPS, _per_step, report

    short = {"controller": 1.0, "client": 2.0, "steps_per_s": 40.0}
    long = {"controller": 1.0 + 2 * STEPS * 0.002, "client": 2.0 + 2 * STEPS * 0.001,
            "steps_per_s": 41.0}
    per_step = _per_step(short, long)
    assert per_step == pytest.approx({"controller": 2.0, "client": 1.0})
    row = {**per_step, "all": 3.0}
    text = report({"isthmus fleet 1x2x4": row, "multi-controller 2x4": {"all": 3.5},
                   "steps/s": {"fleet": 40.0, "twin": 41.0}})
    assert "controller 2.00" in text and "fleet 40.0, twin 41.0" in text


def test_the_loop_and_the_slices_are_reported_against_their_targets():
    from bench.__main__ import dp_report, slices_targets

    piece = {"put_ms": 2.5, "elementwise_ms": 0.8, "sum_ms": 1.5, "sum_fetch_ms": 1.6}
    table = {"local jax 8 devices": {**piece, "steps_per_s": 900.0},
             "multi-controller 2x4": {**piece, "steps_per_s": 47.0, "sum_fetch_ms": 0.3},
             "isthmus fleet 1x2x4": {**piece, "steps_per_s": 45.0, "/ peer": 0.95},
             "fleet, colocated loader": {**piece, "steps_per_s": 51.0, "/ peer": 1.07}}
    text = dp_report(table)
    assert "sharded put 2.50 ms <= 1: NOT met" in text
    assert "+1.30 ms over the twin's, <= 0.5: NOT met" in text
    assert "client-fed 0.95x >= 1.0: NOT met; colocated loader 1.07x: met" in text
    lines = slices_targets({"local jax 8 devices": {}, "fleet 2x1x4, pinned": {
        "weight_copy_GBps": 1.1, "overlap": 1.4}})
    assert lines == ["  fleet 2x1x4, pinned: weight copy 1.10 GB/s >= 1: met; "
                     "overlap 1.40x >= 1.3: met"]


def test_phases_report_gives_each_threads_cpu_between_two_times():
    """bench/phases/report.py: the CPU each thread of a process spent within a window, from
    bench/phases/threads.py's samples (cumulative ns per thread)."""
    from bench.phases.report import _threads_cpu

    samples = [{"t": 1.0, "cpu": {"1 main": 0.0, "2 pool": 5e6}},
               {"t": 2.0, "cpu": {"1 main": 3e6, "2 pool": 5e6}},
               {"t": 3.0, "cpu": {"1 main": 4e6, "2 pool": 205e6, "3 new": 1e6}}]
    # From the last sample at or before the start to the first at or after the end.
    assert _threads_cpu(samples, 1.5, 2.5) == [("2 pool", 200.0), ("1 main", 4.0),
                                               ("3 new", 1.0)]
    assert _threads_cpu(samples, 2.0, 3.0) == [("2 pool", 200.0), ("1 main", 1.0),
                                               ("3 new", 1.0)]
    assert _threads_cpu(samples, 0.5, 2.5) == []  # no sample before the window: unknown


def test_phases_report_counts_the_main_threads_states_within_a_window():
    """bench/phases/report.py: the main thread's (state, system call) samples of
    bench/phases/threads.py inside a window, beside which samples of every thread's CPU
    (taken one in twenty) still give the CPU figures."""
    from bench.phases.report import _main_states, _threads_cpu

    samples = [{"t": 1.0, "main": ["R", "running"], "cpu": {"1 main": 0.0}},
               {"t": 1.1, "main": ["S", "futex"]}, {"t": 1.2, "main": ["S", "futex"]},
               {"t": 1.3, "main": ["D", ""]}, {"t": 2.0, "main": ["R", "running"],
                                                "cpu": {"1 main": 2e6}}]
    assert _main_states(samples, 1.05, 1.5) == {"S futex": 2, "D": 1}
    assert _threads_cpu(samples, 1.05, 1.5) == [("1 main", 2.0)]


def test_phases_report_gives_the_resident_memory_around_a_window():
    from bench.phases.report import _rss

    samples = [{"t": 1.0, "main": ["R", ""], "cpu": {}, "rss_kib": 1000},
               {"t": 1.5, "main": ["R", ""]},
               {"t": 2.0, "main": ["R", ""], "cpu": {}, "rss_kib": 3000}]
    assert _rss(samples, 1.2, 1.8) == (1000, 3000)
    assert _rss(samples, 0.5, 1.8) is None  # no sample before the window


def test_round_trip_and_echo_floor_print_each_part(monkeypatch):
    """bench/round_trip.py on local jax and bench/echo_floor.py's two processes: every part
    measured, with its window (no figure asserted)."""
    import json
    import pathlib
    import subprocess
    import sys

    from bench.round_trip import PARTS, measure

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = measure(5)
    for part in PARTS:
        assert out[part] >= 0 and out[f"{part}_t0"] <= out[f"{part}_t1"], part
    with pytest.raises(SystemExit, match="no part 'nope'"):
        measure(1, ("nope",))
    script = pathlib.Path(__file__).parents[2] / "bench" / "echo_floor.py"
    floor = subprocess.run([sys.executable, str(script), "20"], capture_output=True,
                           text=True, timeout=120, check=True)
    assert set(json.loads(floor.stdout)) == {"unary_p50_ms", "stream_p50_ms"}
