"""The server's Prometheus metrics: one collector that reads the server when scraped.

Nothing here counts. Counters kept as things happen live where they happen (the
controller's `counts.Counts`, the fleet manager's losses, the launcher's restarts); state
(workers, slices, sessions, queues, memory) is read as it is at the scrape.

A scrape has two halves. `FleetCollector.read` reads the server on its event loop's
thread (`web.py` serves from that loop), so it needs no locks; it copies what it reads
(the workers' reports are dicts that a heartbeat replaces, never changes). `families`
turns a reading into metric families, and prometheus_client writes the text; both can run
on another thread, which matters on a large fleet: three memory figures per device are tens
of thousands of samples.

Label sets are bounded by the fleet's shape: slice, device, worker slot, transfer
direction, memory figure. Nothing is labelled per array, session, tenant or lease.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from isthmus.controller.counts import PROGRAM_BUCKETS
from isthmus.ids import SliceId
from isthmus.observe.sources import Host, Sources

# Worker-reported device memory figures (jaxlib's `memory_stats` names) -> the `kind` label.
MEMORY_KINDS = {"bytes_in_use": "in_use", "peak_bytes_in_use": "peak", "bytes_limit": "limit"}


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
    """What one scrape read, copied: safe to format on any thread."""

    runs: dict[int, int]  # slice -> programs executed
    slices: list[SliceId]
    slices_down: frozenset[int]
    program_buckets: list[int]  # per bucket of PROGRAM_BUCKETS, and past the last bound
    program_seconds: float
    put_bytes: int
    fetch_bytes: int
    peer_bytes: int
    compile_hits: int
    compile_misses: int
    trial_compiles: int  # programs the vetting process compiled on trial
    record_hits: int  # programs found vetted in the record beside the compile cache
    hosts: list[Host]
    generation: int
    sessions: int
    losses: int
    restarts: int
    loop_lag: float
    queue_depth: int
    flow_closed: int
    shared: dict[str, Any] | None  # a shared service's figures


class FleetCollector:
    """A prometheus_client collector over one server (`Sources`)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def read(self) -> Reading | None:
        """Reads the server (on its event loop); None before its controller exists."""
        sources = self.sources
        controller = sources.controller
        if controller is None:
            return None
        counts = controller.counts
        fleet = controller.fleet
        return Reading(
            runs=controller.program_runs(), slices=sources.slices(),
            slices_down=frozenset(fleet.down_slices),
            program_buckets=list(counts.program_buckets),
            program_seconds=counts.program_seconds, put_bytes=counts.put_bytes,
            fetch_bytes=counts.fetch_bytes, peer_bytes=counts.peer_bytes,
            compile_hits=counts.compile_hits, compile_misses=counts.compile_misses,
            trial_compiles=controller.vetter.trial_compiles,
            record_hits=controller.vetter.record.hits if controller.vetter.record else 0,
            hosts=sources.hosts(), generation=fleet.generation,
            sessions=sources.session_count(), losses=sources.losses(),
            restarts=sources.restarts(), loop_lag=sources.loop_lag(),
            queue_depth=sources.queue_depth(), flow_closed=fleet.flow.closed_count,
            shared=sources.shared_figures())

    def collect(self) -> Iterator[Metric]:
        reading = self.read()
        if reading is not None:
            yield from families(reading)


def families(s: Reading) -> Iterator[Metric]:
    """The metric families of a reading."""
    executed = CounterMetricFamily(
        "isthmus_programs_executed", "Executes of compiled programs dispatched, by slice (a "
        "program over several slices counts on each).", labels=["slice"])
    for index in s.slices:
        executed.add_metric([str(index)], s.runs.get(index, 0))
    yield executed

    cumulative, total = [], 0
    for bound, count in zip((*PROGRAM_BUCKETS, float("inf")), s.program_buckets):
        total += count
        cumulative.append((_bound(bound), total))
    yield HistogramMetricFamily(
        "isthmus_program_seconds", "Seconds from a program's dispatch until its outputs were "
        "ready, for programs whose outputs a client waited for (a fetch, block_until_ready or "
        "an execution status), timed at the first such wait.",
        buckets=cumulative, sum_value=s.program_seconds)

    transfer = CounterMetricFamily(
        "isthmus_transfer_bytes", "Bytes moved: put (host data stored on devices, per shard), "
        "fetch (device data read back to the host), peer (worker to worker).",
        labels=["direction"])
    transfer.add_metric(["put"], s.put_bytes)
    transfer.add_metric(["fetch"], s.fetch_bytes)
    transfer.add_metric(["peer"], s.peer_bytes)
    yield transfer

    yield _gauge("isthmus_workers_up", "Workers serving their devices (members of the "
                 "current collective group).", sum(h.up for h in s.hosts))
    yield _gauge("isthmus_worker_slots", "Host slots of the fleet (workers it expects).",
                 len(s.hosts))
    yield _gauge("isthmus_slices_up", "Slices whose every host is up.",
                 sum(index not in s.slices_down for index in s.slices))
    yield _gauge("isthmus_slices", "Slices of the fleet.", len(s.slices))
    yield _gauge("isthmus_group_generation", "Formations of the collective group so far "
                 "(each membership change re-forms it).", s.generation)
    yield _gauge("isthmus_sessions", "Open client sessions.", s.sessions)
    yield _counter("isthmus_worker_losses", "Workers lost (disconnected or silent).",
                   s.losses)
    yield _counter("isthmus_worker_restarts", "Workers this server's launcher started again "
                   "after they exited.", s.restarts)
    yield from _worker_reports(s.hosts)
    yield _counter("isthmus_compile_cache_hits", "Compiles answered from the controller's "
                   "executable cache (the program was compiled for those devices already, by "
                   "any session).", s.compile_hits)
    yield _counter("isthmus_compile_cache_misses", "Compiles that compiled the program.",
                   s.compile_misses)
    yield _counter("isthmus_programs_trial_compiled", "Programs the vetting process compiled "
                   "on trial (a CPU fleet's new programs; not those it compiled on trial "
                   "before, with --compile-cache).", s.trial_compiles)
    yield _counter("isthmus_programs_vetted_before", "Programs found vetted in the record "
                   "beside --compile-cache, with no vetting process asked.", s.record_hits)
    yield _gauge("isthmus_event_loop_lag_seconds", "How late the controller's event loop ran "
                 "a timer, at most, over the last few seconds.", s.loop_lag)
    yield _gauge("isthmus_dispatch_queue_depth", "Operations waiting in the sessions' ordered "
                 "queues for their inputs (host data on its way).", s.queue_depth)
    yield _gauge("isthmus_worker_backlog", "Commands sent to workers and not yet applied "
                 "(weight, summed over the workers).", sum(h.backlog for h in s.hosts))
    yield _counter("isthmus_flow_control_closed", "Times a worker's backlog held the clients "
                   "back.", s.flow_closed)
    if s.shared is not None:
        yield from _shared(s.shared)


def _worker_reports(hosts: list[Host]) -> Iterator[Metric]:
    """What the workers report of themselves: memory per device, bytes held, and their
    persistent compilation caches."""
    memory = GaugeMetricFamily(
        "isthmus_device_memory_bytes", "Device memory as each worker's jaxlib client reports "
        "it (GPU clients do; CPU clients report none).", labels=["device", "kind"])
    held = GaugeMetricFamily(
        "isthmus_worker_buffer_bytes", "Bytes of live buffers each worker reports holding.",
        labels=["worker"])
    cache = {"compile_cache_hits": 0, "compile_cache_misses": 0, "kept_executable_hits": 0,
             "programs_compiled": 0, "programs_vetted": 0}
    reporting = False
    for host in hosts:
        reported = host.reported
        if host.up and "bytes" in reported:
            held.add_metric([str(host.slot)], reported["bytes"])
        for key, value in reported.items():
            if key.startswith("memory/"):
                _, device, figure = key.split("/", 2)
                if figure in MEMORY_KINDS:
                    memory.add_metric([device, MEMORY_KINDS[figure]], value)
            elif key in cache:
                cache[key] += value
                reporting = reporting or key.startswith("compile_cache")
    yield memory
    yield held
    yield _counter("isthmus_kept_executable_hits", "Programs the workers loaded, after their "
                   "collective group re-formed, from executables they compiled for a group "
                   "of the same members before, summed over the live workers.",
                   cache["kept_executable_hits"])
    yield _counter("isthmus_worker_programs_compiled", "Programs the live workers compiled "
                   "from the program (not loaded from a cache or the vetting process).",
                   cache["programs_compiled"])
    yield _counter("isthmus_worker_programs_vetted", "Programs the live workers loaded from "
                   "the vetting process's trial compile (a CPU fleet's new programs).",
                   cache["programs_vetted"])
    if reporting:
        yield _counter("isthmus_persistent_cache_hits", "Executables the workers loaded from "
                       "the persistent compilation cache (--compile-cache), summed over the "
                       "live workers.", cache["compile_cache_hits"])
        yield _counter("isthmus_persistent_cache_misses", "Executables the workers compiled "
                       "and did not find in the persistent cache.",
                       cache["compile_cache_misses"])


# A shared service's figures (`LeaseBook.figures` and its lease counts): kind, name, help, key.
_SHARED = (
    ("gauge", "isthmus_shared_leases", "Active leases.", "leases"),
    ("gauge", "isthmus_shared_queue_length", "Lease requests waiting in the queue.", "queued"),
    ("gauge", "isthmus_shared_users_active", "Tenants holding an active lease.",
     "active_users"),
    ("gauge", "isthmus_shared_users_waiting", "Tenants with a lease request queued.",
     "users_waiting"),
    ("gauge", "isthmus_shared_slices_in_use", "Slices leased out.", "capacity_in_use"),
    ("gauge", "isthmus_shared_slices", "Slices the service leases out.", "capacity_total"),
    ("gauge", "isthmus_shared_slices_requested", "Slices active and queued leases want.",
     "requested_capacity"),
    ("counter", "isthmus_shared_lease_grants", "Lease requests granted.",
     "successful_requests"),
    ("counter", "isthmus_shared_lease_refusals", "Lease requests refused.",
     "refused_requests"),
    ("counter", "isthmus_shared_leases_ended", "Leases that ended.", "leases_ended"),
)


def _shared(figures: dict[str, Any]) -> Iterator[Metric]:
    """A shared service's figures, one family each."""
    for kind, name, text, key in _SHARED:
        yield (_gauge if kind == "gauge" else _counter)(name, text, figures[key])
    median = figures.get("assignment_seconds_median")
    if median is not None:
        yield _gauge("isthmus_shared_assignment_seconds_median", "Median seconds from a "
                     "lease request to its grant, over the last 100 grants.", median)


class Collected:
    """Families already made, in the shape `generate_latest` reads (a registry)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
