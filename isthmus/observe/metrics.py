"""The server's Prometheus metrics: one collector that reads the server when scraped.

Nothing here counts. Counters kept as things happen live where they happen (the
controller's `counts.Counts`, the fleet manager's losses, the launcher's restarts); state
(workers, slices, sessions, queues, memory) is read as it is at the scrape. The collector
runs on the server's event loop (`web.py` serves from it), so it reads without locks.

Label sets are bounded by the fleet's shape: slice, device, worker slot, transfer
direction, memory figure. Nothing is labelled per array, session, tenant or lease.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

from isthmus.controller.counts import PROGRAM_BUCKETS
from isthmus.observe.sources import Sources

# Worker-reported device memory figures (jaxlib's `memory_stats` names) -> the `kind` label.
MEMORY_KINDS = {"bytes_in_use": "in_use", "peak_bytes_in_use": "peak", "bytes_limit": "limit"}


class FleetCollector:
    """A prometheus_client collector over one server (`Sources`)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        sources = self.sources
        controller = sources.controller
        if controller is None:  # not started yet
            return
        counts = controller.counts
        fleet = controller.fleet

        executed = CounterMetricFamily(
            "isthmus_programs_executed", "Executes of compiled programs dispatched, by slice "
            "(a program over several slices counts on each).", labels=["slice"])
        runs = controller.program_runs()
        for s in sources.slices():
            executed.add_metric([str(s)], runs.get(s, 0))
        yield executed

        cumulative, total = [], 0
        for bound, count in zip((*PROGRAM_BUCKETS, float("inf")), counts.program_buckets):
            total += count
            cumulative.append((_bound(bound), total))
        yield HistogramMetricFamily(
            "isthmus_program_seconds", "Seconds from a program's dispatch until its outputs "
            "were ready, for programs whose outputs a client waited for (a fetch, "
            "block_until_ready or an execution status), timed at the first such wait.",
            buckets=cumulative, sum_value=counts.program_seconds)

        transfer = CounterMetricFamily(
            "isthmus_transfer_bytes", "Bytes moved: put (host data stored on devices, per "
            "shard), fetch (device data read back to the host), peer (worker to worker).",
            labels=["direction"])
        transfer.add_metric(["put"], counts.put_bytes)
        transfer.add_metric(["fetch"], counts.fetch_bytes)
        transfer.add_metric(["peer"], counts.peer_bytes)
        yield transfer

        hosts = sources.hosts()
        yield _gauge("isthmus_workers_up", "Workers serving their devices (members of the "
                     "current collective group).", sum(h.up for h in hosts))
        yield _gauge("isthmus_worker_slots", "Host slots of the fleet (workers it expects).",
                     len(hosts))
        down = fleet.down_slices
        slices = sources.slices()
        yield _gauge("isthmus_slices_up", "Slices whose every host is up.",
                     sum(s not in down for s in slices))
        yield _gauge("isthmus_slices", "Slices of the fleet.", len(slices))
        yield _gauge("isthmus_group_generation", "Formations of the collective group so far "
                     "(each membership change re-forms it).", fleet.generation)
        yield _gauge("isthmus_sessions", "Open client sessions.", sources.session_count())
        yield _counter("isthmus_worker_losses", "Workers lost (disconnected or silent).",
                       sources.losses())
        yield _counter("isthmus_worker_restarts", "Workers this server's launcher started "
                       "again after they exited.", sources.restarts())

        memory = GaugeMetricFamily(
            "isthmus_device_memory_bytes", "Device memory as each worker's jaxlib client "
            "reports it (GPU clients do; CPU clients report none).", labels=["device", "kind"])
        worker_bytes = GaugeMetricFamily(
            "isthmus_worker_buffer_bytes", "Bytes of live buffers each worker reports "
            "holding.", labels=["worker"])
        cache = {"compile_cache_hits": 0, "compile_cache_misses": 0}
        reporting = False
        for host in hosts:
            reported = host.reported
            if host.up and "bytes" in reported:
                worker_bytes.add_metric([str(host.slot)], reported["bytes"])
            for key, value in reported.items():
                if key.startswith("memory/"):
                    _, device, figure = key.split("/", 2)
                    if figure in MEMORY_KINDS:
                        memory.add_metric([device, MEMORY_KINDS[figure]], value)
                elif key in cache:
                    cache[key] += value
                    reporting = True
        yield memory
        yield worker_bytes
        yield _counter("isthmus_compile_cache_hits", "Compiles answered from the "
                       "controller's executable cache (the program was compiled for those "
                       "devices already, by any session).", counts.compile_hits)
        yield _counter("isthmus_compile_cache_misses", "Compiles that compiled the program.",
                       counts.compile_misses)
        if reporting:
            yield _counter("isthmus_persistent_cache_hits", "Executables the workers loaded "
                           "from the persistent compilation cache (--compile-cache), summed "
                           "over the live workers.", cache["compile_cache_hits"])
            yield _counter("isthmus_persistent_cache_misses", "Executables the workers "
                           "compiled and did not find in the persistent cache.",
                           cache["compile_cache_misses"])

        yield _gauge("isthmus_event_loop_lag_seconds", "How late the controller's event loop "
                     "ran a timer, at most, over the last few seconds.", sources.loop_lag())
        yield _gauge("isthmus_dispatch_queue_depth", "Operations waiting in the sessions' "
                     "ordered queues for their inputs (host data on its way).",
                     sources.queue_depth())
        yield _gauge("isthmus_worker_backlog", "Commands sent to workers and not yet applied "
                     "(weight, summed over the workers).", sum(h.backlog for h in hosts))
        yield _counter("isthmus_flow_control_closed", "Times a worker's backlog held the "
                       "clients back.", fleet.flow.closed_count)

        shared = sources.shared_figures()
        if shared is not None:
            yield from _shared(shared)


def _shared(figures: dict[str, Any]) -> Iterator[Metric]:
    """A shared service's figures (`LeaseBook.figures` and its lease counts)."""
    yield _gauge("isthmus_shared_leases", "Active leases.", figures["leases"])
    yield _gauge("isthmus_shared_queue_length", "Lease requests waiting in the queue.",
                 figures["queued"])
    yield _gauge("isthmus_shared_users_active", "Tenants holding an active lease.",
                 figures["active_users"])
    yield _gauge("isthmus_shared_users_waiting", "Tenants with a lease request queued.",
                 figures["users_waiting"])
    yield _gauge("isthmus_shared_slices_in_use", "Slices leased out.",
                 figures["capacity_in_use"])
    yield _gauge("isthmus_shared_slices", "Slices the service leases out.",
                 figures["capacity_total"])
    yield _gauge("isthmus_shared_slices_requested", "Slices active and queued leases want.",
                 figures["requested_capacity"])
    yield _counter("isthmus_shared_lease_grants", "Lease requests granted.",
                   figures["successful_requests"])
    yield _counter("isthmus_shared_lease_refusals", "Lease requests refused.",
                   figures["refused_requests"])
    yield _counter("isthmus_shared_leases_ended", "Leases that ended.",
                   figures["leases_ended"])
    median = figures.get("assignment_seconds_median")
    if median is not None:
        yield _gauge("isthmus_shared_assignment_seconds_median", "Median seconds from a "
                     "lease request to its grant, over the last 100 grants.", median)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
