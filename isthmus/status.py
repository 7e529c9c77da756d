"""Text rendering of a server's status (for `isthmus status`)."""

from __future__ import annotations

from typing import Any


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(status: dict[str, Any]) -> str:
    lines = [f"platform: {status['platform']['name']}  sessions: {len(status['sessions'])}  "
             f"executables: {status['executables']}"]
    devices = status["devices"]
    slices: dict[int, dict[int, list[int]]] = {}
    workers: dict[int, int] = {}
    for d in devices:
        slices.setdefault(d["slice"], {}).setdefault(d["host"], []).append(d["id"])
        workers[d["host"]] = d["worker"]
    for slice_index in sorted(slices):
        lines.append(f"slice {slice_index}:")
        for host in sorted(slices[slice_index]):
            ids = slices[slice_index][host]
            worker = str(workers.get(host, host))
            w = status["workers"].get(worker, {})
            lines.append(
                f"  host {host} (worker {worker}, {w.get('health', 'healthy')}): devices "
                f"{ids[0]}..{ids[-1]}  arrays: {w.get('buffers', 0)} buffers, "
                f"{_bytes(w.get('bytes', 0))}")
    for sid, s in sorted(status["sessions"].items()):
        lines.append(f"session {sid} from {s['peer']}: {s['arrays']} array handles, "
                     f"{s['requests']} requests")
    return "\n".join(lines)
