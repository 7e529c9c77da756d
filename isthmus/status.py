"""Text rendering of a server's status (for `isthmus status`)."""

from __future__ import annotations

from typing import Any


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


def render(status: dict[str, Any]) -> str:
    """The fleet as a few lines: slices, their hosts and health, arrays held, sessions."""
    lines = [f"platform: {status['platform']['name']}  collective group: "
             f"{status.get('generation', 0)}  sessions: {len(status['sessions'])}  "
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
            lines.append(
                f"  host {host} ({who}): devices {devices[0]['id']}..{devices[-1]['id']}  "
                f"arrays: {account.get('buffers', 0)} buffers, "
                f"{_bytes(account.get('bytes', 0))}" + _device_memory(account))
    for sid, s in sorted(status["sessions"].items()):
        lines.append(f"session {sid} from {s['peer']}: {s['arrays']} array handles, "
                     f"{s['requests']} requests, {_bytes(s['host_buffer_bytes'])} host data "
                     "held")
    return "\n".join(lines)
