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


def _service():
    address = f"127.0.0.1:{free_port()}"
    return address, jax_compat.jaxlib_extension().get_distributed_runtime_service(address, 1)


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
def test_joining_a_cpu_group_schedules_gloos_one_loop_thread(choice):
    address, service = _service()
    before = _batch_threads()
    distributed, client = join_group(address, 0, 1, "cpu", 2, 30, choice)
    try:
        batch = _batch_threads() - before
        assert len(batch) == (1 if choice == "batch" else 0)
        # The group works: its client runs on both devices.
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
