"""The server commands, `isthmus up` and `isthmus run`: their options, the head's config made
from them, the process they prepare, and what they run. `isthmus slurm` runs them too.

Environment variables are read here, at the edge, and nowhere deeper.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from typing import Any

from isthmus import gctune, logs
from isthmus.hostmem import client_allocator_environment
from isthmus.lease_cli import add_client_arguments, add_server_arguments, shared_config
from isthmus.observe.options import (
    ObserveConfig,
    add_observe_arguments,
    keep_event_records,
    observe_config,
)
from isthmus.options import (
    fleet_token,
    platform_arguments,
    platform_config,
    refuse,
    require_affinity,
    tls_arguments,
    tls_config,
)
from isthmus.transport.auth import TOKEN_ENVIRONMENT
from isthmus.worker import scheduling
from isthmus.worker.platforms import (
    Platform,
    PlatformUnavailable,
    check_local_cuda,
    check_local_tpu,
    prepare_process,
    resolve,
    visible_tpu_chips,
)

READY_PREFIX = "isthmus ready: JAX_BACKEND_TARGET="
METRICS_PREFIX = "isthmus: metrics at "  # then the URL, on stderr (`--metrics-port`)
# The user's own C++ log level, read before jax is imported (importing jax sets it to 1).
_USER_LOG_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")


def take_environment(environ: dict[str, str]) -> None:
    """Reads again what this module read from the environment at its import, from
    `environ`: a process forked from a warm Python that imported jax before this module
    (`isthmus/warm_worker.py`) must see the user's level, as a fresh interpreter does."""
    global _USER_LOG_LEVEL
    _USER_LOG_LEVEL = environ.get("TF_CPP_MIN_LOG_LEVEL")


def _default_max_array_bytes() -> int:
    """Half of this machine's physical memory (1 TiB where it cannot be read): an array made
    from host data is cut into its shards in the controller's memory."""
    try:
        return min(1 << 40, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2)
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def add_server_commands(commands: Any) -> None:
    """Adds `up` and `run` to the command line's subcommands."""
    up = commands.add_parser("up", help="run a server in the foreground")
    server_arguments(up)
    run = commands.add_parser(
        "run", help="start a server, run a command against it, stop the server",
        usage="isthmus run [server options] -- CMD [ARGS...]")
    server_arguments(run)
    add_client_arguments(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")


def server_parser() -> argparse.ArgumentParser:
    """A parser of `up ...` and `run ... -- CMD` alone, as `isthmus` parses them."""
    parser = argparse.ArgumentParser(prog="isthmus")
    add_server_commands(parser.add_subparsers(dest="subcommand", required=True))
    return parser


def server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="port to listen on; 0 picks a free one (default: 0; with "
                             "--unix-socket and the embedded backend, no TCP port)")
    parser.add_argument("--devices", type=int, default=None,
                        help="serve N devices from the server process itself (the embedded "
                             "backend) instead of a fleet of workers: N CPU devices, or N "
                             "GPUs with --platform cuda")
    parser.add_argument("--slices", type=int, default=None,
                        help="slices of the fleet (default: 1)")
    parser.add_argument("--hosts-per-slice", type=int, default=None,
                        help="worker processes (hosts) per slice (default: 2)")
    parser.add_argument("--devices-per-host", type=int, default=None,
                        help="devices per worker (default: 4 CPU devices, or 1 GPU)")
    platform_arguments(parser)
    parser.add_argument("--no-launch", action="store_true",
                        help="do not start the workers here; wait for `isthmus worker` "
                             "processes started elsewhere to register")
    parser.add_argument("--no-restart", action="store_true",
                        help="do not restart a launched worker that dies (by default it is "
                             "restarted with a backoff of 0.5 s doubling to 8 s, at most 10 "
                             "times in a row)")
    parser.add_argument("--pin-slices", action="store_true",
                        help="give each slice of a launched fleet a share of this machine's "
                             "CPUs of its own (its workers pinned to them), as slices on "
                             "separate hardware have; by default all workers share all CPUs")
    parser.add_argument("--pin-hosts", action="store_true",
                        help="give each worker (host) of a launched fleet a share of this "
                             "machine's CPUs of its own, as hosts on separate machines have "
                             "(with fewer CPUs than workers, they take turns round them)")
    parser.add_argument("--advertise-host", default=None,
                        help="the address workers use to reach this server (default: --host)")
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help="file holding the fleet's shared secret, which workers must "
                             f"prove they know (default: ${TOKEN_ENVIRONMENT}; with "
                             "neither, any worker that reaches the controller may join); "
                             "launched workers get it")
    tls_arguments(parser)
    parser.add_argument("--fleet-port", type=int, default=0,
                        help="port of the workers' control streams (workers learn it from "
                             "--port); 0 picks a free one (default: 0)")
    parser.add_argument("--fleet-timeout", type=float, default=180.0,
                        help="seconds to wait for every worker to register (default: 180)")
    parser.add_argument("--heartbeat-timeout", type=float, default=4.0,
                        help="seconds without a sign of life after which a worker counts as "
                             "lost (workers pulse every 0.5 s from a thread of their own, "
                             "however busy; default: 4)")
    parser.add_argument("--host-buffer-timeout", type=float, default=10.0,
                        help="seconds a request waits for its host data to start arriving "
                             "(default: 10)")
    parser.add_argument("--executable-cache", type=int, default=256, metavar="N",
                        help="compiled programs kept loaded after every session released "
                             "them, for the next session that compiles the same (each holds "
                             "its machine code on the workers; default: 256)")
    parser.add_argument("--max-array-bytes", type=int, default=_default_max_array_bytes(),
                        help="largest array made from host data (and largest upload) the "
                             "server accepts, in bytes; such arrays pass through the "
                             "controller's memory (default: half of this machine's memory)")
    parser.add_argument("--max-message-bytes", type=int, default=1 << 31,
                        help="largest gRPC message a client may send on the client port, in "
                             "bytes; a larger one fails its call with RESOURCE_EXHAUSTED "
                             "(default: 2 GiB, over anything protobuf can encode)")
    parser.add_argument("--shared-dir", default="auto",
                        help="directory where clients on this machine hand over large host "
                             "buffers through shared memory; 'auto' makes one under /dev/shm, "
                             "'none' (or 'off') turns it off (default: auto)")
    parser.add_argument("--client-transport", choices=("auto", "h2", "grpc"),
                        default=os.environ.get("ISTHMUS_CLIENT_TRANSPORT", "auto"),
                        help="what serves the client port: h2 (HTTP/2 frames handled in "
                             "Python with the h2 library: about a third of grpc.aio's CPU per "
                             "request) or grpc (grpc.aio); auto: h2 when it is installed. "
                             "Default: auto, or $ISTHMUS_CLIENT_TRANSPORT")
    parser.add_argument("--validate", action="store_true",
                        default=os.environ.get("ISTHMUS_VALIDATE", "") not in ("", "0"),
                        help="check the controller's records after every request and fail "
                             "the request that left them inconsistent, logged as 'isthmus "
                             "validate:' (slower; on in the test suite; default: "
                             "$ISTHMUS_VALIDATE)")
    parser.add_argument("--log-level", default=os.environ.get("ISTHMUS_LOG_LEVEL", "WARNING"),
                        help="logging level of the server (default: WARNING)")
    parser.add_argument("--log-format", choices=logs.FORMATS,
                        default=os.environ.get("ISTHMUS_LOG_FORMAT", "text"),
                        help="text, or json: one JSON object per line, with an `event` field "
                             "for the fleet's events (default: text, or $ISTHMUS_LOG_FORMAT)")
    add_server_arguments(parser)
    add_observe_arguments(parser)


def head_config(args: argparse.Namespace) -> object:
    from isthmus.controller.controller import ControllerConfig
    from isthmus.controller.manager import FleetSpec
    from isthmus.head import HeadConfig
    from isthmus.launch import RestartPolicy

    fleet_flags = (args.slices, args.hosts_per_slice, args.devices_per_host)
    if args.devices is not None and any(f is not None for f in fleet_flags):
        refuse("--devices (embedded backend) and the fleet options "
                "(--slices, --hosts-per-slice, --devices-per-host) exclude each other")
    for flag, value in (("--devices", args.devices), ("--slices", args.slices),
                        ("--hosts-per-slice", args.hosts_per_slice),
                        ("--devices-per-host", args.devices_per_host)):
        if value is not None and value < 1:
            refuse(f"{flag} must be at least 1, not {value}")
    for flag, on in (("--pin-slices", args.pin_slices), ("--pin-hosts", args.pin_hosts)):
        if on and (args.devices is not None or args.no_launch):
            refuse(f"{flag} pins the workers this server launches; it has none with "
                   f"{'--devices' if args.devices is not None else '--no-launch'}")
        if on:
            require_affinity(flag)
    if args.devices is None and not args.no_launch:
        try:  # the workers it launches read it; a bad value is refused here, once
            scheduling.from_environment()
        except ValueError as e:
            refuse(str(e))
    platform = platform_config(args)
    fleet = None
    if args.devices is None:
        defaults = FleetSpec()
        # Workers started elsewhere resolve `auto` themselves; the first to register decides.
        name = platform.name if args.no_launch else resolve(platform.name)
        if name == "cuda" and not args.no_launch:
            check_local_cuda()
        hosts = args.hosts_per_slice or defaults.hosts_per_slice
        if name == "tpu" and not args.no_launch:
            try:
                check_local_tpu()
            except PlatformUnavailable as e:
                refuse(e.message)
            # One worker owns this machine's chips (libtpu's unit; one process may hold
            # them). Several TPU hosts are several machines: docs/tpu.md.
            hosts = args.hosts_per_slice or 1
            if (args.slices or 1) * hosts > 1 or (
                    args.devices_per_host not in (None, visible_tpu_chips())):
                refuse(f"a local TPU fleet is one worker owning this machine's "
                       f"{visible_tpu_chips()} chips: drop --slices, --hosts-per-slice and "
                       "--devices-per-host (TPU fleets of several hosts: docs/tpu.md)")
        # A GPU worker owns one GPU; a TPU worker its host's chips.
        per_host = (1 if name == "cuda" else visible_tpu_chips() if name == "tpu"
                    else defaults.devices_per_host)
        fleet = FleetSpec(slices=args.slices or defaults.slices, hosts_per_slice=hosts,
                          devices_per_host=args.devices_per_host or per_host, platform=name)
    token = fleet_token(args)
    # With a Unix socket and no --port, no TCP at all: the embedded backend, or a fleet on
    # this machine whose control streams, peer data and group formation use Unix sockets
    # beside it. A shared service keeps TCP (its tenants come from elsewhere).
    port = args.port if args.port is not None else (
        None if args.unix_socket and args.tenants is None and not args.no_launch else 0)
    beyond = args.host not in ("127.0.0.1", "localhost", "::1")
    if fleet is not None and args.tenants is not None and not token and tls_config(args) is None:
        # A shared service admits only workers that prove they are the fleet's.
        if args.no_launch and beyond:
            refuse(f"a shared service (--tenants) on {args.host} admits only the fleet's own "
                   "workers: give the controller and every worker started elsewhere the same "
                   f"--token-file (or ${TOKEN_ENVIRONMENT}), or mutual TLS (--tls-cert, "
                   "--tls-key, --tls-ca)")
        token = secrets.token_hex(32)  # its own workers' (single-use join tokens from it)
    elif fleet is not None and not token and beyond:
        print(f"isthmus: listening on {args.host} without a fleet token: any process that "
              "reaches the controller can join as a worker; give the controller and every "
              f"worker the same --token-file (or ${TOKEN_ENVIRONMENT})", file=sys.stderr)
    return HeadConfig(
        host=args.host, port=port, unix_socket=None if args.tenants else args.unix_socket,
        devices=args.devices or 8, fleet=fleet,
        platform=_embedded_platform(args) if args.devices is not None else platform,
        launch_workers=not args.no_launch, fleet_timeout=args.fleet_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        restart=RestartPolicy(enabled=not args.no_restart), pin_slices=args.pin_slices,
        pin_hosts=args.pin_hosts,
        advertise_host=args.advertise_host, fleet_port=args.fleet_port,
        fleet_token=token, tls=tls_config(args),
        shared_dir=_shared_dir(args.shared_dir),
        controller=ControllerConfig(host_buffer_timeout=args.host_buffer_timeout,
                                    max_array_bytes=args.max_array_bytes,
                                    compile_cache_size=args.executable_cache,
                                    validate=args.validate),
        max_host_buffer_bytes=args.max_array_bytes, client_transport=args.client_transport,
        max_message_bytes=args.max_message_bytes,
        shared=shared_config(args), observe=_observe_config(args))


def _observe_config(args: argparse.Namespace) -> ObserveConfig | None:
    try:
        return observe_config(args)
    except ValueError as e:
        refuse(str(e))


def _shared_dir(value: str) -> str | None:
    """--shared-dir: 'auto', 'none' (or 'off'), or an existing directory the server may
    write, as an absolute path (the client and the server resolve it alike)."""
    if value in ("auto", "none", "off"):
        return None if value != "auto" else value
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isdir(path):
        refuse(f"--shared-dir {value}: no such directory; give an existing directory, "
                "'auto' (a fresh one under /dev/shm) or 'none'")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        refuse(f"--shared-dir {value}: this user cannot read and write it; give a "
                "directory it can, 'auto' or 'none'")
    return path


def prepare_server_process(args: argparse.Namespace) -> None:
    logs.configure(args.log_level, args.log_format)
    keep_event_records(args)  # the live view's events, whatever the console's level
    os.environ["ISTHMUS_LOG_FORMAT"] = args.log_format  # the workers it launches log alike
    # XLA's C++ warnings (the coordination service's, at every group formation) read like
    # trouble in a healthy server; errors still show. Workers inherit the level.
    if _USER_LOG_LEVEL is None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # The server's own jax must never try to reach a proxy (itself); an embedded backend
    # on GPUs makes its CUDA client by hand, with the GPU settings of the options.
    try:
        prepare_process(_embedded_platform(args) if args.devices is not None else Platform())
    except ValueError as e:
        refuse(str(e))


def _embedded_platform(args: argparse.Namespace) -> Platform:
    """The embedded backend's platform, `auto` resolved; `--devices N` on CUDA without
    --gpus or CUDA_VISIBLE_DEVICES takes GPUs 0 to N-1."""
    import dataclasses

    platform = platform_config(args)
    name = resolve(platform.name)
    if name == "tpu":
        try:
            check_local_tpu()
        except PlatformUnavailable as e:
            refuse(e.message)
    gpus = platform.gpus
    if name == "cuda" and gpus is None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        gpus = tuple(range(args.devices))
    return dataclasses.replace(platform, name=name, gpus=gpus)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _spawn_vetter(args: argparse.Namespace) -> Any:
    """The process that parses client programs, started before the rest of the server's
    imports, so that the two overlap and the server is ready no later for it. jax, which
    both import, is imported first: the process is then forked from this one, still with
    one thread, and spends 0.5-0.65 s of CPU instead of 1.8 s on its start."""
    import jax  # noqa: F401 - the server's own parts import it too

    from isthmus.controller.vetting import vetter_for

    vetter = vetter_for(platform_config(args).compile_cache)
    await vetter.spawn(fork=True)
    return vetter


async def _head(args: argparse.Namespace) -> Any:
    """The head of `isthmus up/run`, its vetting process spawned first; a refused option
    stops that process before the one line goes out (its transport must not outlive the
    loop)."""
    vetter = await _spawn_vetter(args)
    try:
        from isthmus.head import Head

        config: Any = head_config(args)
        if (config.fleet is not None and config.launch_workers and config.shared is None
                and config.fleet.platform == "cpu"):
            from isthmus import warm_start

            warm_start.prepare(dict(os.environ))  # forked now, while this has one thread
        return Head(config, vetter)
    except BaseException:
        await vetter.close()
        raise


async def up(args: argparse.Namespace) -> int:
    head = await _head(args)
    stop = _stop_event()
    starting = asyncio.ensure_future(head.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # stopped while the fleet was still gathering
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await head.stop()
        return 0
    address = starting.result()
    gctune.settle()
    _announce_observer(head)
    print(f"{READY_PREFIX}{address}", flush=True)
    extra = head.client_environment()
    if extra:
        print("isthmus: clients on this machine may also set "
              + " ".join(f"{k}={v}" for k, v in extra.items())
              + " to hand over large arrays through shared memory", file=sys.stderr, flush=True)
    try:
        await stopping
    finally:
        await head.stop()
    return 0


def _announce_observer(head: object) -> None:
    observer = getattr(head, "observer", None)
    if observer is not None:
        print(f"{METRICS_PREFIX}{observer.url}/metrics (live view: {observer.url}/)",
              file=sys.stderr, flush=True)


def child_environment(address: str, base: dict[str, str] | None = None,
                      extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that points a child's stock jax at the server at `address`."""
    import isthmus._bootstrap as bootstrap

    env = dict(os.environ if base is None else base)
    env.update(extra or {})
    env["JAX_PLATFORMS"] = "proxy"
    env["JAX_BACKEND_TARGET"] = address
    env["IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"] = "true"
    # Quiet the stock client's C++ warnings (insecure credentials, and a "disconnected:
    # CANCELLED" stack trace at exit that reads like a crash) unless the user set a level.
    level = env.get("TF_CPP_MIN_LOG_LEVEL") if base is not None else _USER_LOG_LEVEL
    env["TF_CPP_MIN_LOG_LEVEL"] = level or "2"
    folder = os.path.dirname(bootstrap.__file__)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (folder, env.get("PYTHONPATH", "")) if p)
    return env


async def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("isthmus run: give a command after --, e.g. isthmus run -- python train.py",
              file=sys.stderr)
        return 2
    private = None
    if args.unix_socket is None and args.tenants is None:
        # The command's own socket: nothing to race for, and only this user may connect.
        import tempfile

        from isthmus.ports import tcp_available

        private = tempfile.mkdtemp(prefix="isthmus-run-")  # mode 0700
        args.unix_socket = os.path.join(private, "client.sock")
        if args.port is None and args.devices is None and tcp_available():
            args.port = 0  # a fleet keeps TCP among its processes where it may
    try:
        head = await _head(args)
    except BaseException:
        _remove(private)
        raise
    try:
        address = await head.start()
    except BaseException:
        _remove(private)
        raise
    if args.unix_socket and args.tenants is None:
        address = f"grpc://unix:{args.unix_socket}"
    gctune.settle()
    _announce_observer(head)
    try:
        # The client's allocator keeps what large transfers touched (hostmem.CLIENT_TUNABLES).
        extra = {**head.client_environment(), **client_allocator_environment(dict(os.environ))}
        child = await asyncio.create_subprocess_exec(
            *command, env=child_environment(address, extra=extra), stdin=None)
    except OSError as e:
        await head.stop()
        _remove(private)
        print(f"isthmus run: cannot start {command[0]!r}: {e}", file=sys.stderr)
        return 127
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, child.send_signal, sig)
    try:
        code = await child.wait()
    finally:
        await head.stop()
        _remove(private)
    return code if code >= 0 else 128 - code


def _remove(directory: str | None) -> None:
    if directory is not None:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


