"""The observer's parts without sockets or processes: the collector over a controller and a
stand-in fleet, the counts it reads, the event ring, the console levels with metrics on,
and the web server's answers."""

import asyncio
import logging
import os
import types

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from isthmus import errors
from isthmus.controller.controller import Controller
from isthmus.controller.counts import PROGRAM_BUCKETS, Counts
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.logs import event
from isthmus.observe.events import EventLog
from isthmus.observe.metrics import FleetCollector
from isthmus.observe.observer import _exposition
from isthmus.observe.options import keep_event_records
from isthmus.observe.sources import Sources
from isthmus.observe.state import view_state
from isthmus.observe.web import WebServer, _loopback_name


class Channel:
    local = False  # a worker process's, as far as the controller can tell

    """A worker channel that only reports figures."""

    def __init__(self, reported):
        self.reported = reported

    def stats(self):
        return dict(self.reported)


def make_head(shared=None):
    """A controller over 2 slices x 1 host x 2 devices; slice 1's worker is gone."""
    devices = [Device(DeviceId(i), WorkerId(i // 2), i % 2, "cuda", "H100", SliceId(i // 2), 0)
               for i in range(4)]
    worker = Channel({"buffers": 3, "bytes": 4096, "compile_cache_hits": 2,
                      "compile_cache_misses": 1, "device_bytes_in_use": 300,
                      "memory/0/bytes_in_use": 100, "memory/0/peak_bytes_in_use": 150,
                      "memory/0/bytes_limit": 1000, "memory/1/bytes_in_use": 200})
    fleet = WholeFleet(devices, {WorkerId(0): worker})
    fleet.mark_down(SliceId(1), errors.WorkerLost("worker b:7 (slice 1, host 0) was lost"))
    controller = Controller(fleet)
    frontend = types.SimpleNamespace(controller=controller, sessions={})
    return types.SimpleNamespace(frontend=frontend, manager=None, shared=shared,
                                 launcher=types.SimpleNamespace(restarted=2))


def scrape(head, lag=0.25):
    """The exposition as the observer writes it (a reading, then the text), checked to be
    what a plain registry over the same collector writes."""
    collector = FleetCollector(Sources(head, lambda: lag))
    text = _exposition(collector.read()).decode()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    assert generate_latest(registry).decode() == text
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}


def test_collector_reads_counts_fleet_and_worker_reports():
    head = make_head()
    counts = head.frontend.controller.counts
    counts.put_bytes, counts.fetch_bytes, counts.peer_bytes = 10, 20, 30
    counts.compile_hits, counts.compile_misses = 4, 2
    counts.retired_runs = {0: 7, 1: 3}
    for seconds in (0.0004, 0.001, 0.003, 100.0):
        counts.observe_program(seconds)
    found = scrape(head)

    assert samples(found["isthmus_programs_executed"]) == {
        ("isthmus_programs_executed_total", (("slice", "0"),)): 7,
        ("isthmus_programs_executed_total", (("slice", "1"),)): 3}
    assert samples(found["isthmus_transfer_bytes"]) == {
        ("isthmus_transfer_bytes_total", (("direction", "put"),)): 10,
        ("isthmus_transfer_bytes_total", (("direction", "fetch"),)): 20,
        ("isthmus_transfer_bytes_total", (("direction", "peer"),)): 30}
    histogram = samples(found["isthmus_program_seconds"])
    assert histogram[("isthmus_program_seconds_bucket", (("le", "0.0005"),))] == 1
    assert histogram[("isthmus_program_seconds_bucket", (("le", "0.001"),))] == 2  # le: <=
    assert histogram[("isthmus_program_seconds_bucket", (("le", "0.005"),))] == 3
    assert histogram[("isthmus_program_seconds_bucket", (("le", "60.0"),))] == 3
    assert histogram[("isthmus_program_seconds_bucket", (("le", "+Inf"),))] == 4
    assert histogram[("isthmus_program_seconds_count", ())] == 4
    assert histogram[("isthmus_program_seconds_sum", ())] == pytest.approx(100.0044)

    def one(name):
        [(_, value)] = samples(found[name]).items()
        return value

    assert one("isthmus_workers_up") == 1 and one("isthmus_worker_slots") == 2
    assert one("isthmus_slices_up") == 1 and one("isthmus_slices") == 2
    assert one("isthmus_sessions") == 0 and one("isthmus_worker_losses") == 0
    assert one("isthmus_worker_restarts") == 2
    assert one("isthmus_compile_cache_hits") == 4 and one("isthmus_compile_cache_misses") == 2
    assert one("isthmus_persistent_cache_hits") == 2
    assert one("isthmus_event_loop_lag_seconds") == 0.25
    assert one("isthmus_dispatch_queue_depth") == 0
    assert samples(found["isthmus_device_memory_bytes"]) == {
        ("isthmus_device_memory_bytes", (("device", "0"), ("kind", "in_use"))): 100,
        ("isthmus_device_memory_bytes", (("device", "0"), ("kind", "peak"))): 150,
        ("isthmus_device_memory_bytes", (("device", "0"), ("kind", "limit"))): 1000,
        ("isthmus_device_memory_bytes", (("device", "1"), ("kind", "in_use"))): 200}
    assert samples(found["isthmus_worker_buffer_bytes"]) == {
        ("isthmus_worker_buffer_bytes", (("worker", "0"),)): 4096}
    assert not any(name.startswith("isthmus_shared") for name in found)


def test_view_state_is_a_tree_with_reasons():
    head = make_head()
    head.frontend.controller.counts.retired_runs = {0: 5}
    state = view_state(Sources(head), EventLog(), 0.0)
    up, down = state["slices"]
    assert up["up"] and not down["up"] and "was lost" in down["why"]
    assert up["hosts"][0]["state"] == "up" and up["hosts"][0]["pid"] == os.getpid()
    assert down["hosts"][0]["state"] == "down" and "was lost" in down["hosts"][0]["why"]
    assert [d["id"] for d in up["hosts"][0]["devices"]] == [0, 1]
    assert up["hosts"][0]["devices"][0]["memory"] == {"in_use": 100, "peak": 150,
                                                      "limit": 1000}
    assert state["counters"]["programs"] == 5 and state["shared"] is None


def test_a_shared_service_adds_its_figures():
    figures = {"active_users": 1, "capacity_in_use": 1, "capacity_total": 2,
               "requested_capacity": 3, "assignment_seconds_median": 0.5,
               "successful_requests": 4, "users_waiting": 1, "refused_requests": 0,
               "leases_ended": 2}
    book = {"leases": [{"id": "l1"}], "queue": [{"id": "l2"}, {"id": "l3"}], "free": [1],
            "scrubbing": [], "figures": figures}
    shared = types.SimpleNamespace(book=types.SimpleNamespace(describe=lambda: book))
    found = scrape(make_head(shared))
    values = {name: f.samples[0].value for name, f in found.items()
              if name.startswith("isthmus_shared")}
    assert values == {"isthmus_shared_leases": 1, "isthmus_shared_queue_length": 2,
                      "isthmus_shared_users_active": 1, "isthmus_shared_users_waiting": 1,
                      "isthmus_shared_slices_in_use": 1, "isthmus_shared_slices": 2,
                      "isthmus_shared_slices_requested": 3,
                      "isthmus_shared_lease_grants": 4, "isthmus_shared_lease_refusals": 0,
                      "isthmus_shared_leases_ended": 2,
                      "isthmus_shared_assignment_seconds_median": 0.5}


def test_a_program_is_timed_once_at_the_first_wait_on_any_output():
    counts = Counts()
    stamp = [1.0]  # dispatched long ago (perf_counter() is far past 1.0)
    first, second = (types.SimpleNamespace(beside=types.SimpleNamespace(dispatched=stamp))
                     for _ in range(2))
    counts.waited([first])
    counts.waited([second, types.SimpleNamespace(beside=None)])
    assert counts.program_count == 1 and counts.program_buckets[-1] == 1  # over 60 s
    assert first.beside.dispatched is None and second.beside.dispatched is None
    counts.retire([0, 1], 3)
    counts.retire([1], 0)
    assert counts.retired_runs == {0: 3, 1: 3}
    assert len(counts.program_buckets) == len(PROGRAM_BUCKETS) + 1


def test_event_log_keeps_events_and_warnings_in_a_ring():
    log = EventLog(capacity=3)
    logger = logging.getLogger("isthmus.test_observe")
    logger.addHandler(log)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        logger.info("session %s opened", 1)  # no event: not kept
        logger.info("worker %s joined", "a", extra=event("worker_joined", slice=0))
        logger.warning("worker %s lost", "a", extra=event("worker_lost", slice=0))
        logger.warning("something odd")
        logger.info("compiled f", extra=event("compiled", program="f"))
    finally:
        logger.removeHandler(log)
        logger.setLevel(old)
    recent = log.recent()
    assert [e["kind"] for e in recent] == ["worker_lost", "warning", "compiled"]
    assert recent[0]["message"] == "worker a lost" and recent[0]["fields"] == {"slice": 0}
    assert recent[1]["level"] == "warning" and log.count == 4


def test_metrics_keep_info_records_while_the_console_keeps_its_level():
    root, isthmus_logger = logging.getLogger(), logging.getLogger("isthmus")
    saved = (root.level, isthmus_logger.level, root.handlers[:])
    handler = logging.StreamHandler()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    try:
        keep_event_records(types.SimpleNamespace(metrics_port=None))
        assert isthmus_logger.level == saved[1] and handler.level == logging.NOTSET
        keep_event_records(types.SimpleNamespace(metrics_port=0))
        assert handler.level == logging.WARNING
        assert logging.getLogger("isthmus.controller.manager").isEnabledFor(logging.INFO)
        assert not logging.getLogger("jax").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved[0])
        isthmus_logger.setLevel(saved[1])
        root.handlers[:] = saved[2]


def test_web_server_answers_get_only_for_a_loopback_host():
    def broken(headers):
        raise RuntimeError("no")

    async def later(headers):
        return "text/plain", b"later"

    server = WebServer({"/": lambda headers: ("text/plain", b"hi"), "/broken": broken,
                        "/later": later})
    server._loopback = True

    def answer(request):
        status, headers, body, method = asyncio.run(server._answer(request.encode()))
        return status.split()[0], dict(headers), body

    assert answer("GET /?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n") == (
        "200", {"Content-Type": "text/plain"}, b"hi")
    assert answer("HEAD / HTTP/1.1\r\nHost: localhost\r\n\r\n")[0] == "200"
    assert answer("GET /later HTTP/1.1\r\nHost: localhost\r\n\r\n")[2] == b"later"
    assert answer("GET /none HTTP/1.1\r\nHost: [::1]:9\r\n\r\n")[0] == "404"
    assert answer("DELETE / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[1]["Allow"] == "GET, HEAD"
    assert answer("GET / HTTP/1.1\r\nHost: attacker.example\r\n\r\n")[0] == "403"
    assert answer("GET / HTTP/1.1\r\n\r\n")[0] == "403"  # no Host
    assert answer("GET /\r\n\r\n")[0] == "400"
    assert answer("GET /broken HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == "500"
    server._loopback = False  # bound elsewhere: the operator chose who reaches it
    assert answer("GET / HTTP/1.1\r\nHost: node7.cluster:9100\r\n\r\n")[0] == "200"
    assert _loopback_name("127.0.0.2") and not _loopback_name("10.0.0.1:80")


def test_a_fleet_s_hosts_join_the_group_before_they_count_as_up():
    head = make_head()
    head.manager = types.SimpleNamespace(
        status=lambda: {"0": {"host": "node-a", "pid": 41, "backlog": 5, "member": False}},
        lost_count=3)
    head.frontend.controller.fleet.members = set()  # registered, group not formed yet
    hosts = Sources(head).hosts()
    assert [(h.state, h.hostname, h.pid, h.backlog) for h in hosts] == [
        ("joining", "node-a", 41, 5), ("down", "", None, 0)]
    found = scrape(head)
    assert found["isthmus_workers_up"].samples[0].value == 0
    assert found["isthmus_worker_losses"].samples[0].value == 3
    assert found["isthmus_worker_backlog"].samples[0].value == 5
