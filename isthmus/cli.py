"""The `isthmus` command: its subcommands, and which module runs each (`up` and `run`:
serve.py; `worker`; `slurm` and `k8s`: deploy/; `status`; `leases`).

Environment variables are read here and nowhere deeper; components get typed configs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from isthmus import logs, serve
from isthmus.deploy.commands import add_deploy_commands, k8s_command, slurm_command
from isthmus.lease_cli import add_leases_command, leases_command, service_run
from isthmus.options import (
    fleet_token,
    pin_to_cpus,
    platform_arguments,
    platform_config,
    refuse,
    tls_arguments,
    tls_config,
)
from isthmus.transport.auth import TOKEN_ENVIRONMENT
from isthmus.worker import scheduling
from isthmus.worker.platforms import PlatformUnavailable, prepare_process

logger = logging.getLogger("isthmus.cli")


def _worker(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from isthmus.worker import sandbox, supervise
    from isthmus.worker.agent import WorkerConfig, run_worker
    from isthmus.worker.crashes import (
        CRASH_RECORD_ENV,
        TEST_CRASH_ENV,
        TEST_RAISE_ENV,
        CrashConfig,
    )
    from isthmus.worker.process import block_stop_signals, exit_with_parent

    if args.cpus is not None:
        pin_to_cpus(args.cpus)  # before any thread or child: both inherit it
    if not (args.exit_with_parent or args.no_supervise
            or os.environ.get(supervise.ENVIRONMENT)):
        # Rejoins a controller that crashed and came back; keeps the crash records of the
        # processes it starts (in $ISTHMUS_CRASH_RECORD, or a directory of its own).
        return supervise.supervise(argv, os.environ.get(CRASH_RECORD_ENV) or None)
    block_stop_signals()  # before any thread starts
    logs.configure(args.log_level, os.environ.get("ISTHMUS_LOG_FORMAT", "text"),
                   "%(asctime)s %(levelname)s worker %(name)s: %(message)s")
    confining = os.environ.pop(sandbox.ENVIRONMENT, None)
    if confining is not None:  # a shared service's worker: before any thread, any jax
        try:
            sandbox.confine(sandbox.Sandbox.decode(confining))
        except (OSError, ImportError, ValueError) as e:
            print(f"isthmus worker: cannot confine this worker ({e}); a shared service's "
                  "workers run only confined", file=sys.stderr)
            return 2
    platform = platform_config(args)
    try:
        prepare_process(platform)  # before jax is imported: GPUs owned, memory settings
    except ValueError as e:
        print(f"isthmus worker: {e}", file=sys.stderr)
        return 2
    if args.exit_with_parent:
        exit_with_parent()
    token = fleet_token(args)
    if args.connect_timeout <= 0:
        refuse(f"--connect-timeout must be positive, not {args.connect_timeout:g}")
    try:
        gloo_scheduling = args.gloo_scheduling or scheduling.from_environment()
    except ValueError as e:
        refuse(str(e))
    config = WorkerConfig(controller=args.controller, slice_index=args.slice,
                          devices=args.devices, platform=platform, token=token,
                          tls=tls_config(args), connect_timeout=args.connect_timeout,
                          listen=_listen(args), advertise=args.advertise,
                          gloo_scheduling=gloo_scheduling,
                          argv=(sys.executable, "-m", "isthmus.cli", *argv),
                          crash=CrashConfig(os.environ.get(CRASH_RECORD_ENV) or None,
                                            os.environ.get(TEST_CRASH_ENV, ""),
                                            os.environ.get(TEST_RAISE_ENV, "")))
    try:
        return asyncio.run(run_worker(config))
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isthmus", description="An open single-controller runtime for JAX.")
    commands = parser.add_subparsers(dest="subcommand", required=True)
    serve.add_server_commands(commands)
    worker = commands.add_parser("worker", help="serve this host's devices to a controller")
    worker.add_argument("--controller", required=True,
                        help="HOST:PORT of the controller, or unix:PATH of its Unix socket "
                             "(a fleet on one machine without TCP)")
    worker.add_argument("--slice", type=int, default=-1,
                        help="the slice to join (default: any slice with a free host slot)")
    worker.add_argument("--devices", type=int, default=4,
                        help="CPU devices (default: 4); a CUDA worker serves its GPUs")
    platform_arguments(worker)
    worker.add_argument("--cpus", default=None, metavar="LIST",
                        help="run on these CPUs only, e.g. 0-3,8 (default: all this process "
                             "may use); XLA sizes its thread pools to them")
    worker.add_argument("--gloo-scheduling", choices=scheduling.CHOICES, default=None,
                        help="how the OS schedules the thread that carries CPU collectives "
                             "between workers: batch (no preemption on each message: faster "
                             "unless other processes keep every CPU busy) or normal (default: "
                             f"${scheduling.ENVIRONMENT}, else {scheduling.DEFAULT}; "
                             "docs/design.md)")
    worker.add_argument("--listen", default=None,
                        help="address for the peer data server, or unix:DIR for a Unix "
                             "socket in DIR (default: 127.0.0.1; beside the controller's "
                             "socket when --controller is unix:PATH)")
    worker.add_argument("--advertise", default=None,
                        help="address peers use to reach this worker (default: --listen)")
    worker.add_argument("--connect-timeout", type=float, default=180.0,
                        help="seconds to wait for the controller, at start and after it went "
                             "away (it may start later, or restart); then exit (default: 180)")
    worker.add_argument("--token-file", default=None, metavar="PATH",
                        help="file holding the fleet's shared secret (default: "
                             f"${TOKEN_ENVIRONMENT}; none: a controller without one)")
    tls_arguments(worker)
    worker.add_argument("--no-supervise", action="store_true",
                        help="run the worker in this process; by default a supervising "
                             "process starts it again when it dies because its controller "
                             "crashed, so that it rejoins the controller when that is back")
    worker.add_argument("--exit-with-parent", action="store_true",
                        help="exit when the parent process exits (used by local fleets)")
    worker.add_argument("--log-level", default=os.environ.get("ISTHMUS_LOG_LEVEL", "WARNING"))
    add_deploy_commands(commands, platform_arguments)
    status = commands.add_parser("status", help="print a running server's fleet and arrays")
    status.add_argument("--controller", required=True, help="HOST:PORT of the server")
    status.add_argument("--json", action="store_true", help="print raw JSON")
    status.add_argument("--timeout", type=float, default=10.0)
    status.add_argument("--token-file", default=None, metavar="PATH",
                        help="a shared service: a tenant's secret (an admin's shows sessions "
                             "and memory too); without it only a caller on the service's own "
                             "machine is told the status")
    status.add_argument("--service-ca", default=os.environ.get("ISTHMUS_SERVICE_CA"),
                        metavar="PEM", help="a shared service's certificate to trust")
    status.add_argument("--buffer", type=int, default=None, metavar="ID",
                        help="show one buffer's last moves (pending, defined, stored, failed, "
                             "deleted, freed) and the request or event that caused each")
    status.add_argument("--array", default=None, metavar="SESSION:HANDLE",
                        help="the same for each buffer of a session's array (session ids are "
                             "in the plain status; handles are the client's)")
    add_leases_command(commands)
    return parser


def _session_handle(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        session, handle = (int(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"isthmus status: --array is SESSION:HANDLE (two integers), not "
                         f"{text!r}") from None
    return session, handle


def _listen(args: argparse.Namespace) -> str:
    """A worker's peer data server: --listen, else beside a controller reached at
    unix:PATH (a fleet without TCP), else the loopback."""
    if args.listen is not None:
        return str(args.listen)
    if args.controller.startswith("unix:"):
        return "unix:" + os.path.dirname(args.controller.removeprefix("unix:"))
    return "127.0.0.1"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.subcommand == "status":
        from isthmus.status import command as status_command

        return status_command(args.controller, args.timeout, args.json, args.token_file,
                              args.service_ca, args.buffer, _session_handle(args.array))
    if args.subcommand == "worker":
        return _worker(args, argv)
    if args.subcommand == "k8s":
        return k8s_command(args)
    if args.subcommand == "slurm":
        return slurm_command(args)
    if args.subcommand == "leases":
        return leases_command(args)
    if args.subcommand == "run" and args.service:
        command = list(args.command)
        command = command[1:] if command[:1] == ["--"] else command
        if not command:
            refuse("give a command after --, e.g. isthmus run --service HOST:PORT -- python "
                    "train.py")
        return service_run(args, command, serve.child_environment)
    serve.prepare_server_process(args)
    try:
        if args.subcommand == "up":
            return asyncio.run(serve.up(args))
        return asyncio.run(serve.run(args))
    except KeyboardInterrupt:
        return 0
    except (OSError, TimeoutError, PlatformUnavailable) as e:
        from isthmus.wire.servicer import CannotListen

        print(f"isthmus {args.subcommand}: {e}", file=sys.stderr)
        return 2 if isinstance(e, CannotListen) else 1


if __name__ == "__main__":
    sys.exit(main())
