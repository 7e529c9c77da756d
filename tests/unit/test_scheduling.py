"""The scheduling of a CPU group's gloo loop thread (`isthmus/worker/scheduling.py`), on a
real one-member group made in this process."""

import os
import threading

import pytest

from isthmus.compat import jax as jax_compat
from isthmus.ports import free_port
from isthmus.worker import scheduling
from isthmus.worker.platforms import join_group

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or
                                not os.path.isdir("/proc/self/task"),
                                reason="Linux thread scheduling")


def test_the_environment_names_batch_or_normal():
    assert scheduling.from_environment({}) == "batch"
    assert scheduling.from_environment({scheduling.ENVIRONMENT: " normal "}) == "normal"
    with pytest.raises(ValueError, match="ISTHMUS_GLOO_SCHEDULING='fast': choose batch or normal"):
        scheduling.from_environment({scheduling.ENVIRONMENT: "fast"})


def test_only_threads_python_does_not_know_count_as_started():
    def make():
        thread = threading.Thread(target=done.wait)
        thread.start()
        return thread

    done = threading.Event()
    thread, started = scheduling.started_by(make)
    try:
        assert thread.native_id not in started and started == set()
    finally:
        done.set()
        thread.join()


def _service(members=1):
    address = f"127.0.0.1:{free_port()}"
    return address, jax_compat.jaxlib_extension().get_distributed_runtime_service(
        address, members)


def _batch_threads():
    found = set()
    for thread in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(thread)) == os.SCHED_BATCH:
                found.add(int(thread))
        except ProcessLookupError:
            pass
    return found


@pytest.mark.parametrize("choice", ["batch", "normal"])
def test_gloos_one_loop_thread_is_scheduled_as_asked(choice):
    """What `join_group` does for a CPU group of several members, on a one-member runtime:
    gloo's loop thread, started by making the collectives, gets the scheduling asked for."""
    _jax = jax_compat.jaxlib_extension()
    address, service = _service()
    distributed = _jax.get_distributed_runtime_client(
        address, 0, init_timeout=30, shutdown_on_destruction=False)
    distributed.connect()
    before = _batch_threads()
    collectives, started = scheduling.started_by(
        lambda: _jax.make_gloo_tcp_collectives(distributed))
    scheduling.schedule_loop(started, choice)
    try:
        batch = _batch_threads() - before
        assert len(batch) == (1 if choice == "batch" else 0)
    finally:
        del collectives
        distributed.shutdown()
        service.shutdown()


def test_a_group_of_one_member_makes_no_gloo():
    """A one-host group crosses no processes: no gloo (whose TCP sockets a sandbox may
    refuse), no loop thread."""
    address, service = _service()
    before = _batch_threads()
    distributed, client = join_group(address, 0, 1, "cpu", 2, 30, "batch")
    try:
        assert _batch_threads() - before == set()
        assert len(client.local_devices()) == 2
    finally:
        del client
        distributed.shutdown()
        service.shutdown()


def test_anything_but_one_new_thread_is_left_alone():
    assert scheduling.schedule_loop(set(), "batch") is None
    mine = threading.get_native_id()
    assert scheduling.schedule_loop({mine, mine + 1}, "batch") is None
    assert scheduling.schedule_loop({mine}, "normal") is None
    assert os.sched_getscheduler(0) != os.SCHED_BATCH
