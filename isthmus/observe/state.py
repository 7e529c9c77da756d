"""The web view's data (`/api/state`): the fleet as a tree, the counters, sessions, leases
and recent events, in one JSON object. Rates are the page's to work out, from the
difference between two polls of the counters.

As for the metrics, `read` reads the server on its event loop and `render` (the hosts'
entries and the JSON text, most of the work on a large fleet) may run on another thread.
"""

from __future__ import annotations

import json
import time
from typing import Any

from isthmus.controller.counts import PROGRAM_BUCKETS
from isthmus.observe.events import EventLog
from isthmus.observe.metrics import MEMORY_KINDS
from isthmus.observe.sources import Host, Sources


def view_state(sources: Sources, events: EventLog | None, started: float) -> dict[str, Any]:
    """The view's data as plain JSON values."""
    return _plain(read(sources, events, started))


def render(state: dict[str, Any]) -> bytes:
    """A reading as the JSON the page reads (on any thread)."""
    return json.dumps(_plain(state), default=str).encode()


def read(sources: Sources, events: EventLog | None, started: float) -> dict[str, Any]:
    """Reads the server (on its event loop): the view's data, with each slice's hosts as
    `Host` records (which `render` writes out)."""
    controller = sources.controller
    if controller is None:
        return {"time": time.time(), "starting": True}
    counts = controller.counts
    fleet = controller.fleet
    hosts = sources.hosts()
    by_slice: dict[int, list[Host]] = {}
    for host in hosts:
        by_slice.setdefault(host.slice_index, []).append(host)
    down = fleet.down_slices
    slices = []
    for s in sources.slices():
        error = down.get(s)
        slices.append({"index": s, "up": error is None,
                       "why": error.message if error is not None else None,
                       "hosts": by_slice.get(s, [])})
    runs = controller.program_runs()
    book = sources.shared_book()
    return {
        "time": time.time(),
        "uptime": time.monotonic() - started,
        "platform": fleet.platform,
        "generation": fleet.generation,
        "slices": slices,
        "counters": {
            "programs": sum(runs.values()),
            "programs_by_slice": {str(s): n for s, n in sorted(runs.items())},
            "program_seconds": {"sum": counts.program_seconds, "count": counts.program_count,
                                "bounds": list(PROGRAM_BUCKETS),
                                "buckets": list(counts.program_buckets)},
            "put_bytes": counts.put_bytes, "fetch_bytes": counts.fetch_bytes,
            "peer_bytes": counts.peer_bytes,
            "compile_hits": counts.compile_hits, "compile_misses": counts.compile_misses,
            "worker_losses": sources.losses(), "worker_restarts": sources.restarts(),
        },
        "gauges": {
            "workers_up": sum(h.up for h in hosts), "worker_slots": len(hosts),
            "slices_up": sum(s["up"] for s in slices), "slices": len(slices),
            "sessions": sources.session_count(), "queue_depth": sources.queue_depth(),
            "worker_backlog": sum(h.backlog for h in hosts),
            "loop_lag_seconds": sources.loop_lag(),
            "flow_open": fleet.flow.is_open,
        },
        # No peer addresses: the view is an operator's, but may be reachable by more people.
        "sessions": [{"id": int(s.id), "requests": s.requests, "arrays": len(s.arrays),
                      "tenant": s.lease.tenant.name if s.lease is not None else None}
                     for s in sources.sessions()],
        "shared": book,
        "events": events.recent() if events is not None else [],
    }


def redacted(state: dict[str, Any]) -> dict[str, Any]:
    """A shared service's view for a request without an admin's token: the fleet's health
    and aggregate figures; no tenant's name, lease, session or program (events name them)."""
    shared = state.get("shared")
    return {**state, "sessions": [], "events": [],
            "shared": shared and {**shared, "leases": [], "queue": []},
            "redacted": "tenants' leases, sessions and events are shown with an admin's token "
                        "(Authorization: Bearer TOKEN; the page: open it as /#token=TOKEN)"}


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    if "slices" not in state:
        return state
    return {**state, "slices": [{**s, "hosts": [_host(h) for h in s["hosts"]]}
                                for s in state["slices"]]}


def _host(host: Host) -> dict[str, Any]:
    memory: dict[int, dict[str, int]] = {}
    for key, value in host.reported.items():
        if key.startswith("memory/"):
            _, device, figure = key.split("/", 2)
            if figure in MEMORY_KINDS and device.isdigit():
                memory.setdefault(int(device), {})[MEMORY_KINDS[figure]] = value
    return {
        "slot": int(host.slot), "host": host.host_index, "state": host.state, "why": host.why,
        "hostname": host.hostname, "pid": host.pid, "backlog": host.backlog,
        "buffers": host.reported.get("buffers"), "bytes": host.reported.get("bytes"),
        "devices": [{"id": int(d.id), "kind": d.kind, "platform": d.platform,
                     "memory": memory.get(int(d.id))} for d in host.devices],
    }
