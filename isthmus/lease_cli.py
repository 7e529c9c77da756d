"""The command line of a shared service: `isthmus up --tenants`, `isthmus run --service`,
and `isthmus leases` (docs/shared.md)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from isthmus.options import refuse

if TYPE_CHECKING:
    from isthmus.head import SharedConfig


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """`isthmus up/run`: serve as a shared service."""
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="serve as a shared service: the TOML file of its tenants "
                             "(tokens, quotas, priorities, admins); every client then needs "
                             "a lease (docs/shared.md)")
    parser.add_argument("--service-cert", default=None, metavar="PEM",
                        help="TLS certificate of a shared service's client port (default: a "
                             "self-signed one made at start, written beside the tenants "
                             "file, for users' --service-ca)")
    parser.add_argument("--service-key", default=None, metavar="PEM", help="its private key")
    parser.add_argument("--unix-socket", default=None, metavar="PATH",
                        help="also serve the client port on this Unix socket (mode 0600: "
                             "this user's clients only; they connect to grpc://unix:PATH): "
                             "on the embedded backend without --port, no TCP port at all "
                             "(for machines where none may be opened); `isthmus run` hands "
                             "its command a private one by default. A shared service serves "
                             "its tunnels there (no TLS needed on this machine)")
    parser.add_argument("--allow-plain-connect", action="store_true",
                        help="accept tenants' tunnels in clear over TCP (the stock client's "
                             "grpc_proxy route): their tokens cross the network unencrypted")
    parser.add_argument("--auth-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="a shared service closes a connection that has not said who it "
                             "is (a tenant's tunnel, a worker's pulse) this long after it "
                             "opened (default: 5)")
    parser.add_argument("--peer-connections", type=int, default=16, metavar="N",
                        help="connections without credentials one address may hold open at "
                             "once (default: 16; not counted: this machine's own)")
    parser.add_argument("--peer-requests", type=float, default=20.0, metavar="N",
                        help="new connections and calls without credentials one address may "
                             "make a second (default: 20; not counted: this machine's own)")


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """`isthmus run --service`: lease slices of a shared service for the command."""
    parser.add_argument("--service", default=None, metavar="HOST:PORT",
                        help="run the command on slices leased from this shared service (its "
                             "--port, or unix:PATH) instead of starting a server; "
                             "--token-file is then the tenant's secret and --slices the "
                             "slices to lease")
    parser.add_argument("--service-ca", default=os.environ.get("ISTHMUS_SERVICE_CA"),
                        metavar="PEM",
                        help="the service's certificate to trust (default: "
                             "$ISTHMUS_SERVICE_CA, else the system's CAs)")
    parser.add_argument("--tenant", default="",
                        help="the tenant's name (default: the one the token belongs to)")
    parser.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                        help="seconds to wait in the service's queue at most; 0: fail at once "
                             "when nothing is free (default: as long as it takes)")
    parser.add_argument("--lease-name", default="",
                        help="name the lease (at most 64 letters, digits, '_', '.' and '-'): "
                             "a command restarted within the service's grace period gets it "
                             "back")
    parser.add_argument("--elastic", action="store_true",
                        help="the job survives losing slices (pathwaysutils' elastic Manager): "
                             "a higher priority may reclaim some; they come back when free")


def add_leases_command(commands: Any) -> None:
    leases = commands.add_parser("leases", help="list (or revoke) a shared service's leases")
    leases.add_argument("--controller", required=True,
                        help="HOST:PORT of the shared service (or unix:PATH)")
    leases.add_argument("--token-file", required=True, metavar="PATH",
                        help="an admin tenant's secret")
    leases.add_argument("--service-ca", default=os.environ.get("ISTHMUS_SERVICE_CA"),
                        metavar="PEM", help="the service's certificate to trust")
    leases.add_argument("--revoke", default=None, metavar="LEASE",
                        help="end this lease (its arrays are freed)")
    leases.add_argument("--json", action="store_true", help="print raw JSON")


def shared_config(args: argparse.Namespace) -> SharedConfig | None:
    """The `SharedConfig` of `isthmus up --tenants`, or None."""
    from isthmus.head import SharedConfig

    if args.tenants is None:
        for flag in ("service_cert", "service_key"):
            if getattr(args, flag):
                refuse(f"--{flag.replace('_', '-')} is for a shared service: add --tenants")
        return None
    if (args.service_cert is None) != (args.service_key is None):
        refuse("give both --service-cert and --service-key, or neither (a self-signed "
                "certificate is made)")
    from isthmus.controller.tenants import load

    try:
        load(args.tenants)  # refused now, in one line, rather than at start
    except ValueError as e:
        refuse(str(e))
    from isthmus.wire.peers import Limits

    if not (args.auth_timeout > 0 and args.peer_connections > 0 and args.peer_requests > 0):
        refuse("--auth-timeout, --peer-connections and --peer-requests must be > 0")
    return SharedConfig(args.tenants, args.service_cert, args.service_key,
                        unix_socket=args.unix_socket,
                        allow_plain_connect=args.allow_plain_connect,
                        limits=Limits(args.auth_timeout, args.peer_connections,
                                      args.peer_requests))


def service_run(args: argparse.Namespace, command: list[str],
                environment: Callable[[str], dict[str, str]]) -> int:
    """`isthmus run --service`: the command runs on a lease; its exit releases it. Ctrl-C
    while queued leaves the queue; later it goes to the command."""
    import subprocess

    from isthmus import shared

    holding = shared.lease(args.service, slices=args.slices or 1, token_file=args.token_file,
                           ca=args.service_ca, tenant=args.tenant, wait=args.wait,
                           name=args.lease_name, elastic=args.elastic)
    try:
        grant = holding.__enter__()
    except shared.LeaseRefused as e:
        print(f"isthmus run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("isthmus run: left the queue", file=sys.stderr)
        return 130
    try:
        print(f"isthmus run: lease {grant.lease} granted: slices {list(grant.slices)}",
              file=sys.stderr, flush=True)
        try:
            child = subprocess.Popen(command, env=environment(grant.target))
        except OSError as e:
            print(f"isthmus run: cannot start {command[0]!r}: {e}", file=sys.stderr)
            return 127
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _frame: child.send_signal(s))
        code = child.wait()
        return code if code >= 0 else 128 - code
    finally:
        holding.__exit__(None, None, None)


def leases_command(args: argparse.Namespace) -> int:
    """`isthmus leases`: one line per lease and queued request (or JSON)."""
    import grpc

    from isthmus import shared

    service = args.controller.removeprefix("grpc://")
    try:
        token = shared.read_token_file(args.token_file)
        forwarder = shared.Forwarder(service, token, args.service_ca)
    except shared.LeaseRefused as e:
        print(f"isthmus leases: {e}", file=sys.stderr)
        return 2
    try:
        forwarder.check()
        control = forwarder.listen("control", "control")
        with grpc.insecure_channel(f"unix:{control}") as channel:
            if args.revoke:
                call = channel.unary_unary("/isthmus.Shared/Revoke")
                answer = json.loads(call(json.dumps({"lease": args.revoke}).encode(),
                                         timeout=10))
                print(f"revoked {answer['revoked']}")
                return 0
            call = channel.unary_unary("/isthmus.Shared/Leases")
            listing = json.loads(call(b"{}", timeout=10))
    except shared.LeaseRefused as e:
        print(f"isthmus leases: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"isthmus leases: {e.details() or e.code()}", file=sys.stderr)
        return 1
    finally:
        forwarder.close()
    if args.json:
        print(json.dumps(listing, indent=1, sort_keys=True))
        return 0
    print(render(listing))
    return 0


def render(listing: dict[str, Any]) -> str:
    """The leases, the queue and the service's figures as text."""
    figures = listing["figures"]
    lines = [f"slices: {figures['capacity_in_use']} of {figures['capacity_total']} leased, "
             f"free {listing['free']}; users active {figures['active_users']}, waiting "
             f"{figures['users_waiting']}; grants {figures['successful_requests']}"]
    for lease in listing["leases"]:
        lost = f" (reclaimed {lease['reclaimed']})" if lease["reclaimed"] else ""
        away = "" if lease["holders"] else " (client away)"
        lines.append(f"  {lease['id']:<6} {lease['tenant']:<12} slices {lease['slices']}"
                     f"{lost} priority {lease['priority']}{away} {lease['name']}".rstrip())
    for queued in listing["queue"]:
        lines.append(f"  queued {queued['position']}: {queued['id']} {queued['tenant']} "
                     f"wants {queued['wanted']}, waited {queued['waited']:.0f} s")
    return "\n".join(lines)
