"""`isthmus slurm` without Slurm: what it reads from the allocation, and the controller's
command line it builds, checked with isthmus's own parser. A shared service's options reach
the controller as given (every option `isthmus up` has for it), a shared service refuses a
client command, and bad options are refused with one line before any worker starts. The
real thing runs in tests/integration/test_slurm.py."""

import argparse
import os
import pathlib
import subprocess
import sys

import pytest

from isthmus.cli import build_parser
from isthmus.deploy import slurm
from isthmus.deploy.commands import service_options
from isthmus.lease_cli import add_server_arguments, shared_config

ROOT = pathlib.Path(__file__).parents[2]
ALLOCATION = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "node1"}


def test_plan_reads_the_allocation():
    fleet = slurm.plan(ALLOCATION, 2, 8, 8470)
    assert (fleet.job_id, fleet.workers, fleet.slices, fleet.host, fleet.port) == (
        "77", 4, 2, "node1", 8470)
    for environ, per_slice, message in (
            ({}, 1, "SLURM_JOB_ID is not set"),
            ({"SLURM_JOB_ID": "77"}, 1, "no task count"),
            (ALLOCATION, 3, "4 tasks, not a multiple of --hosts-per-slice 3")):
        with pytest.raises(ValueError, match=message) as refused:
            slurm.plan(environ, per_slice, 8, 0)
        assert "\n" not in str(refused.value)


def test_the_controller_command_line():
    fleet = slurm.plan(ALLOCATION, 2, 8, 8470)
    args = build_parser().parse_args(slurm.server_arguments(
        fleet, ["--platform", "cuda", "--log-level", "INFO"], ["python", "train.py"]))
    assert args.subcommand == "run" and args.command[-2:] == ["python", "train.py"]
    assert (args.slices, args.hosts_per_slice, args.devices_per_host) == (2, 2, 8)
    assert (args.host, args.advertise_host, args.port) == ("0.0.0.0", "node1", 8470)
    assert args.no_launch and args.platform == "cuda" and args.tenants is None
    assert "--controller" in slurm.worker_step(fleet, [])[-1]


def slurm_args(*options):
    return build_parser().parse_args(["slurm", *options])


def test_a_shared_service_gets_every_option_as_given(tmp_path):
    given = ["--tenants", str(tmp_path / "tenants.toml"), "--service-cert", "c.pem",
             "--service-key", "k.pem", "--unix-socket", str(tmp_path / "s.sock"),
             "--allow-plain-connect"]
    assert service_options(slurm_args()) == []
    options = service_options(slurm_args(*given))
    fleet = slurm.plan(ALLOCATION, 1, 4, 8470)
    server = build_parser().parse_args(slurm.server_arguments(fleet, [], [], options))
    assert server.subcommand == "up" and server.port == 8470
    # Every option of a shared service's server, whatever add_server_arguments holds now.
    just_service = argparse.ArgumentParser()
    add_server_arguments(just_service)
    expected = vars(just_service.parse_args(given))
    assert expected and {k: getattr(server, k) for k in expected} == expected


def test_a_shared_service_loads_its_tenants(tmp_path):
    (tmp_path / "tenants.toml").write_text(
        '[tenants.alice]\ntoken_file = "alice.token"\nmax_slices = 1\n')
    (tmp_path / "alice.token").write_text("alice-secret\n")
    options = service_options(slurm_args("--tenants", str(tmp_path / "tenants.toml")))
    fleet = slurm.plan(ALLOCATION, 2, 4, 8470)
    shared = shared_config(build_parser().parse_args(
        slurm.server_arguments(fleet, [], [], options)))
    assert shared.tenants == str(tmp_path / "tenants.toml") and shared.cert is None


def test_a_shared_service_takes_no_client_command():
    fleet = slurm.plan(ALLOCATION, 1, 4, 0)
    with pytest.raises(ValueError, match="drop the command after --") as refused:
        slurm.server_arguments(fleet, [], ["python", "train.py"], ["--tenants", "t.toml"])
    assert "\n" not in str(refused.value)


def test_bad_service_options_are_refused_with_one_line_before_workers_start(tmp_path):
    # No srun on PATH: a refusal that came after the workers' step would fail otherwise.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
           **ALLOCATION, "PATH": os.path.dirname(sys.executable), "PYTHONPATH": str(ROOT)}
    (tmp_path / "tenants.toml").write_text("[tenants.alice]\nmax_slices = 1\n")
    for options, message in (
            (["--tenants", "missing.toml"], "cannot read the tenants file missing.toml"),
            (["--tenants", "tenants.toml"], "[tenants.alice]"),  # it names no token
            (["--unix-socket", "s.sock"], "--unix-socket is for a shared service: add "
                                          "--tenants"),
            (["--tenants", "tenants.toml", "--service-cert", "c.pem"],
             "give both --service-cert and --service-key"),
            (["--tenants", "tenants.toml", "--", "python", "train.py"],
             "drop the command after --")):
        result = subprocess.run([sys.executable, "-m", "isthmus.cli", "slurm", *options],
                                cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().count("\n") == 0, result.stderr
        assert message in result.stderr, result.stderr
