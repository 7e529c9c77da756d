"""`isthmus status`: asks a server for its status and shows it (text, or JSON)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def command(controller: str, timeout: float, as_json: bool, token_file: str | None = None,
            service_ca: str | None = None, buffer: int | None = None,
            array: tuple[int, int] | None = None) -> int:
    """Prints the status of the server at `controller` (a shared service's through a tunnel
    with the tenant's token of `token_file`), or with `buffer` that buffer's last moves (with
    `array`, (session, handle): its buffers'); 1 (and one line on stderr) when it cannot be
    reached, 2 when it refused."""
    from isthmus.wire.servicer import fetch_status

    try:
        status = (fetch_status(controller, timeout, buffer, array) if token_file is None
                  else fetch_shared_status(controller, token_file, service_ca, timeout,
                                           buffer, array))
    except Exception as e:  # noqa: BLE001 - report any connection failure plainly
        # A gRPC error's str() is a multi-line dump; its code and details are the one line.
        code, details = getattr(e, "code", None), getattr(e, "details", None)
        why = (f"{code().name}: {details()}" if callable(code) and callable(details)
               else str(e))
        why = " ".join(why.split())  # one line, whatever the transport says
        if callable(code) and code().name in ("UNAUTHENTICATED", "PERMISSION_DENIED",
                                              "INVALID_ARGUMENT", "NOT_FOUND") or (
                type(e).__name__ == "LeaseRefused"):  # it answered: its reason is the line
            print(f"isthmus status: {why}", file=sys.stderr)
            return 2
        print(f"isthmus status: cannot reach {controller} ({why}); is the server running "
              "there (isthmus up prints its address)?", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(render(status) if buffer is None and array is None
              else render_moves(status))
    return 0


def fetch_shared_status(service: str, token_file: str, ca: str | None, timeout: float,
                        buffer: int | None = None, array: tuple[int, int] | None = None
                        ) -> dict[str, Any]:
    """A shared service's status asked on a control tunnel with a tenant's token."""
    import grpc

    from isthmus import shared
    from isthmus.wire.servicer import ADMIN_SERVICE, status_query

    forwarder = shared.Forwarder(service.removeprefix("grpc://"),
                                 shared.read_token_file(token_file), ca)
    try:
        forwarder.check()
        control = forwarder.listen("control", "control")
        with grpc.insecure_channel(f"unix:{control}") as channel:
            call = channel.unary_unary(f"/{ADMIN_SERVICE}/Status")
            return dict(json.loads(call(status_query(buffer, array), timeout=timeout)))
    finally:
        forwarder.close()


def _device_memory(account: dict[str, Any]) -> str:
    """`  device memory: 1.0 GiB in use (peak 2.0 GiB) of 60.0 GiB`, where the worker's client
    keeps such figures (GPUs)."""
    if "device_bytes_in_use" not in account:
        return ""
    text = f"  device memory: {_bytes(account['device_bytes_in_use'])} in use"
    if "device_peak_bytes_in_use" in account:
        text += f" (peak {_bytes(account['device_peak_bytes_in_use'])})"
    if "device_bytes_limit" in account:
        text += f" of {_bytes(account['device_bytes_limit'])}"
    return text


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_moves(status: dict[str, Any]) -> str:
    """One buffer's moves (an array's: each of its buffers'), oldest first, each with its
    time and cause."""
    if "array" in status:
        head = f"array {status['array']} of session {status['session']}: "
        if "error" in status:
            return head + f"failed ({status['error']})"
        return "\n".join([head + f"{status['state']}, {len(status['buffers'])} buffers"]
                         + [render_moves(b) for b in status["buffers"]])
    moves = status["transitions"]
    lines = [f"buffer {status['buffer']}: {status['state']} now; "
             + (f"its last {len(moves)} moves of the {status['kept']} the server keeps:"
                if moves else f"none of the {status['kept']} moves the server keeps "
                "concern it (older ones have left the log, or no such buffer was made)")]
    for move in moves:
        at = time.strftime("%H:%M:%S", time.localtime(move["at"])) + f".{move['at'] % 1:.3f}"[2:]
        where = "" if move["positions"] is None else f" (its group's shards {move['positions']})"
        what = (f"made {move['new']}" if move["old"] is None
                else f"{move['old']} -> {move['new']}")
        lines.append(f"  {at}  {what}{where}  by {move['cause']}")
    return "\n".join(lines)


def render(status: dict[str, Any]) -> str:
    """The fleet as a few lines: slices, their hosts and health, arrays held, sessions."""
    sessions = status.get("sessions_open", len(status.get("sessions", {})))
    lines = [f"platform: {status['platform']['name']}  collective group: "
             f"{status.get('generation', 0)}  sessions: {sessions}  "
             f"executables: {status['executables']}"]
    hosts: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for d in status["devices"]:
        hosts.setdefault(d["slice"], {}).setdefault(d["host"], []).append(d)
    down = status.get("slices_down", {})
    fleet = status.get("fleet", {})
    for slice_index in sorted(hosts):
        reason = down.get(str(slice_index))
        lines.append(f"slice {slice_index}: " + ("up" if reason is None else f"DOWN ({reason})"))
        for host in sorted(hosts[slice_index]):
            devices = hosts[slice_index][host]
            slot = str(devices[0]["worker"])
            account = status["workers"].get(slot, {})
            process = fleet.get(slot)
            who = (f"{process['host']}:{process['pid']}" if process
                   else ("in-process" if not fleet and reason is None else "no worker"))
            if process and process.get("shared_memory"):
                who += ", shared memory"
            if process and process.get("backlog"):  # commands sent, not yet applied
                who += f", backlog {process['backlog']}" + (
                    f": {process['applying']}" if process.get("applying") else "")
            lines.append(
                f"  host {host} ({who}): devices {devices[0]['id']}..{devices[-1]['id']}  "
                f"arrays: {account.get('buffers', 0)} buffers, "
                f"{_bytes(account.get('bytes', 0))}" + _device_memory(account))
    for sid, s in sorted(status.get("sessions", {}).items()):
        lines.append(f"session {sid} from {s['peer']}: {s['arrays']} array handles, "
                     f"{s['requests']} requests, {_bytes(s['host_buffer_bytes'])} host data "
                     "held")
    shared = status.get("shared")
    if shared is not None:
        median = shared["assignment_seconds_median"]
        lines.append(
            f"shared service: {shared['active_users']} users active, "
            f"{shared['users_waiting']} waiting; slices leased {shared['capacity_in_use']} of "
            f"{shared['capacity_total']}, requested {shared['requested_capacity']}; "
            f"{shared['successful_requests']} leases granted"
            + (f" (median {median:.3f} s to grant)" if median is not None else "")
            + f", {shared['refused_requests']} refused (isthmus leases lists them)")
    return "\n".join(lines)
