"""The resource manager and the remote channel, driven without sockets or workers."""

import asyncio
import dataclasses
import os
import types

import pytest

from isthmus import errors
from isthmus.controller.arrays import Buffer
from isthmus.controller.controller import Controller
from isthmus.controller.fleet import WholeFleet
from isthmus.controller.manager import FleetManager, FleetSpec, ManagerConfig
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport import remote
from isthmus.transport.remote import RemoteWorker


def register(slice_index=-1, devices=2, pid=1):
    return m.Register(m.PROTOCOL_VERSION, slice_index, devices, "cpu", "cpu", "127.0.0.1:1",
                      "host", pid)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


_TWO_BY_TWO = FleetSpec(slices=2, hosts_per_slice=2, devices_per_host=2)  # 8 devices


def _manager(spec=_TWO_BY_TWO):
    fleet = WholeFleet([], {})
    controller = Controller(fleet)
    manager = FleetManager(spec, fleet, on_slice_down=controller.ledger.poison_slice)
    return manager, fleet, controller


def test_slots_device_ids_and_refusals():
    async def main():
        manager, fleet, _ = _manager()
        assert [d.id for d in fleet.devices] == list(range(8))
        assert fleet.slice_error(0) is not None  # down until its hosts arrive
        sent = []
        a = manager.register(register(slice_index=1, pid=10), sent.append, "peer")
        b = manager.register(register(slice_index=1, pid=11), sent.append, "peer")
        assert (a.slot, b.slot) == (2, 3)  # slice 1, hosts 0 and 1
        assert manager.welcome(b) == m.Welcome(3, 1, 1, manager.config.heartbeat_interval,
                                               token=b.token, controller=manager.incarnation,
                                               data_key=b.data_key)
        assert a.token != b.token and len(b.token) == 16
        assert a.data_key != b.data_key and len(b.data_key) == 64
        # Pulses: a member carries on; a lost (or unknown) membership starts afresh.
        assert manager.alive(b.token) == m.ALIVE_OK
        assert manager.alive("no-such-token") == m.ALIVE_DROPPED
        with pytest.raises(errors.InvalidRequest, match="already has its 2 live hosts"):
            manager.register(register(slice_index=1), sent.append, "peer")
        with pytest.raises(errors.InvalidRequest, match="--devices 2"):
            manager.register(register(devices=3), sent.append, "peer")
        c = manager.register(register(pid=12), sent.append, "peer")  # any slice: slice 0
        assert c.slot == 0
        d = manager.register(register(slice_index=5, pid=13), sent.append, "peer")
        assert d.slot == 10 and fleet.device(20).slice_index == 5
    run(main())


def test_a_lost_worker_poisons_its_slice_only():
    async def main():
        manager, fleet, controller = _manager()
        closed = []
        workers = [manager.register(register(slice_index=s, pid=20 + 2 * s + h),
                                    lambda frame: None, "peer",
                                    close=lambda s=s, h=h: closed.append((s, h)))
                   for s in (0, 1) for h in (0, 1)]
        for s in (0, 1):
            fleet.mark_up(s)
        group = controller.ledger.new_group((fleet.device(1), fleet.device(5)), (4, 4))
        on_slice0, on_slice1 = Buffer(group, 0), Buffer(group, 1)
        pending, future = workers[2].request()
        manager.lost(workers[2], "it crashed")
        error = fleet.slice_error(1)
        assert isinstance(error, errors.WorkerLost) and error.code == errors.Code.DATA_LOSS
        assert "host:22" in error.message  # hostname:pid of the lost worker
        assert "slice 1" in error.message and "it crashed" in error.message
        assert on_slice1.error is error and on_slice0.error is None
        assert group.first_problem() is error
        assert fleet.slice_error(0) is None
        assert future.exception() is error
        assert closed == [(1, 0)]
        assert 4 not in fleet.workers  # the slot is free for a replacement
        again = manager.register(register(slice_index=1, pid=30), lambda frame: None, "peer")
        assert again.slot == 2 and fleet.slice_error(1) is error  # up at the next group
    run(main())


def test_remote_commands_travel_in_one_batch_per_turn():
    async def main():
        frames = []
        worker = RemoteWorker(0, register(), frames.append, "peer")
        worker.send(c.Copy(1, 2, 0, None))
        worker.send(c.Free((3, 4)))
        worker.send(c.Execute(7, (1,), (9,)))
        assert frames == []
        await asyncio.sleep(0)
        batch = m.decode(frames[0])
        assert len(frames) == 1 and [type(c).__name__ for c in batch.commands] == [
            "Copy", "Free", "Execute"]
        worker.hold()
        worker.send(c.Free((5,)))
        await asyncio.sleep(0)
        assert len(frames) == 1  # held while the collective group re-forms
        worker.release()
        assert m.decode(frames[1]).commands == (c.Free((5,)),)
        ready = worker.ask(c.Ready((9,)))
        await asyncio.sleep(0)
        [ask] = m.decode(frames[2]).commands
        assert ask.command == c.Ready((9,))
        request = ask.request
        worker.on_message(m.Reply(request, error=errors.ExecutionError("boom")))
        with pytest.raises(errors.ExecutionError, match="boom"):
            await ready
    run(main())


def test_a_lone_free_waits_to_ride_with_the_next_command():
    async def main():
        frames = []
        worker = RemoteWorker(0, register(), frames.append, "peer")
        worker.send(c.Free((1,)))
        await asyncio.sleep(0)
        assert frames == []  # not worth a frame of its own yet
        worker.send(c.Copy(2, 3, 0, None))
        await asyncio.sleep(0)
        assert [m.decode(f).commands for f in frames] == [(c.Free((1,)), c.Copy(2, 3, 0, None))]
        worker.send(c.Free((4,)))
        await asyncio.sleep(remote.FREE_DELAY * 3)
        assert m.decode(frames[1]).commands == (c.Free((4,)),)  # alone, it still goes out
    run(main())


def test_shared_memory_only_for_a_worker_that_reads_the_probe(tmp_path):
    async def main():
        fleet = WholeFleet([], {})
        manager = FleetManager(FleetSpec(slices=1, hosts_per_slice=2, devices_per_host=2),
                               fleet, ManagerConfig(shared_dir=str(tmp_path)))
        near, far = (manager.register(register(slice_index=0, pid=p), lambda f: None, "peer")
                     for p in (1, 2))
        probes = [manager.welcome(w).shared_probe for w in (near, far)]
        path, token = probes[0]
        assert open(path).read() == token and probes[1][1] != token
        far.on_message(m.SharedDir("/somewhere/else"))  # not our directory: keep streaming
        near.on_message(m.SharedDir(str(tmp_path)))
        assert near.shared_dir == str(tmp_path) and far.shared_dir is None
        assert not os.path.exists(path)  # the probe is removed once answered
    run(main())


def test_the_first_worker_describes_the_devices_and_others_must_match():
    async def main():
        manager, fleet, _ = _manager(FleetSpec(slices=2, hosts_per_slice=1, devices_per_host=1,
                                               platform="auto"))
        gpu = m.Register(m.PROTOCOL_VERSION, 0, 1, "cuda", "NVIDIA H200", "127.0.0.1:1", "host",
                         1, ("device", "pinned_host"))
        manager.register(gpu, [].append, "peer")
        assert {(d.platform, d.kind, d.memory_kinds) for d in fleet.devices} == {
            ("cuda", "NVIDIA H200", ("device", "pinned_host"))}
        assert fleet.platform == "cuda"
        cpu = m.Register(m.PROTOCOL_VERSION, 1, 1, "cpu", "cpu", "127.0.0.1:2", "host", 2)
        with pytest.raises(errors.InvalidRequest, match="--platform cuda"):
            manager.register(cpu, [].append, "peer")
        other = dataclasses.replace(gpu, slice_index=1, device_kind="NVIDIA A100", pid=3)
        with pytest.raises(errors.InvalidRequest, match="same kind of device"):
            manager.register(other, [].append, "peer")
        two = dataclasses.replace(gpu, slice_index=1, devices=2, pid=4)
        with pytest.raises(errors.InvalidRequest, match="1 GPUs"):
            manager.register(two, [].append, "peer")
        manager.register(dataclasses.replace(gpu, slice_index=1, pid=5), [].append, "peer")
        assert fleet.device(1).kind == "NVIDIA H200"
    run(main())


def test_a_cpu_fleet_refuses_a_gpu_worker():
    async def main():
        manager, _, _ = _manager()
        gpu = m.Register(m.PROTOCOL_VERSION, 0, 2, "cuda", "NVIDIA H200", "127.0.0.1:1", "host",
                         1, ("device", "pinned_host"))
        with pytest.raises(errors.InvalidRequest, match="serves cpu"):
            manager.register(gpu, [].append, "peer")
    run(main())


def test_accelerators_get_colocated_cpu_devices_beside_them():
    async def main():
        manager, fleet, _ = _manager(FleetSpec(slices=2, hosts_per_slice=1, devices_per_host=2,
                                               platform="auto"))
        assert fleet.companions == ()  # none until a worker says its devices have them
        gpu = m.Register(m.PROTOCOL_VERSION, 0, 2, "cuda", "NVIDIA H200", "127.0.0.1:1", "host",
                         1, ("device", "pinned_host"), True)
        manager.register(gpu, [].append, "peer")
        assert [d.id for d in fleet.devices] == [0, 1, 2, 3]  # what jax.devices() lists
        cpus = fleet.companions
        assert [d.id for d in cpus] == [(1 << 20) + i for i in range(4)]
        assert [d.colocation_id for d in cpus] == [d.colocation_id for d in fleet.devices]
        assert {(d.platform, d.kind) for d in cpus} == {("cpu", "cpu")}
        for cpu, gpu_device in zip(cpus, fleet.devices):
            assert (cpu.worker, cpu.slice_index, cpu.host_index, cpu.local_id) == (
                gpu_device.worker, gpu_device.slice_index, gpu_device.host_index,
                gpu_device.local_id)
            assert fleet.device(cpu.id) is cpu
        # A slice added later gets them too; a worker without them is refused.
        manager.register(dataclasses.replace(gpu, slice_index=2, pid=2), [].append, "peer")
        assert fleet.device((1 << 20) + 5).slice_index == 2
        plain = dataclasses.replace(gpu, slice_index=1, pid=3, companions=False)
        with pytest.raises(errors.InvalidRequest, match="colocated CPU devices"):
            manager.register(plain, [].append, "peer")
    run(main())


def test_a_worker_holding_commands_it_applies_none_of_while_idle_is_lost():
    """Issue 36: a worker whose command loop stopped reported idle heartbeats while the
    controller's backlog to it stayed non-zero, and its readers waited forever. The manager
    notices (heartbeats: messages queued, nothing being applied, no progress) and declares it
    lost, naming the cause and its log, so that what waits on it fails with DATA_LOSS."""
    async def main():
        manager, fleet, controller = _manager()
        reg = dataclasses.replace(register(slice_index=0, pid=41), log="/tmp/w-s0-h0.log")
        worker = manager.register(reg, lambda frame: None, "peer")
        busy = manager.register(register(slice_index=0, pid=42), lambda frame: None, "peer")
        fleet.mark_up(0)
        pending, future = worker.request()
        for channel in (worker, busy):
            channel.send(c.Free((1,)))
            channel.flush()
            assert channel.backlog > 0
        now = worker.last_seen
        # A long program: it applies nothing, but says what it waits for. Not a stall.
        busy.on_message(m.Heartbeat({}, 0, 3, "program 5 waits for the collective programs "
                                                "before it"))
        described = manager.status()[str(busy.slot)]  # what `isthmus status` shows
        assert described["queued"] == 3 and described["applying"].startswith("program 5")
        worker.on_message(m.Heartbeat({}, 0, 0, ""))  # nothing read yet: in transit
        assert worker.stalled(now + 60) == 0 and busy.stalled(now + 60) == 0
        worker.on_message(m.Heartbeat({}, 0, 2, ""))  # read, held, and idle: stalled
        began = worker.last_seen
        later = began + manager.config.stall_timeout + 0.5
        # A stopped command loop leaves the event loop free: its heartbeats keep saying so.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(remote, "time", types.SimpleNamespace(monotonic=lambda: later))
            worker.on_message(m.Heartbeat({}, 0, 2, ""))
        for channel in (worker, busy):
            channel.last_seen = later  # their pulses keep coming: alive, not silent
        manager.judge(began + 1.0)
        assert worker.lost is None  # not yet for long
        manager.judge(later)
        error = worker.lost
        assert isinstance(error, errors.WorkerLost) and error.code == errors.Code.DATA_LOSS
        assert "command loop has stopped" in error.message and "/tmp/w-s0-h0.log" in error.message
        assert future.exception() is error
        assert busy.lost is None or busy.lost is error  # lost with its slice, never on its own
        # Progress resets the clock: a worker that applied something is not stalled.
        other = manager.register(register(slice_index=1, pid=43), lambda frame: None, "peer")
        other.send(c.Free((2,)))
        other.flush()
        other.on_message(m.Heartbeat({}, 0, 1, ""))
        other.on_message(m.Heartbeat({}, 0, 1, "compiling program 3"))
        assert other.stalled(other.last_seen + 60) == 0
    run(main())


def test_a_worker_busy_applying_a_backlog_sends_no_heartbeat_and_is_not_declared_stalled():
    """A worker applying a long backlog of steps holds its event loop: its last heartbeat
    said "commands held, nothing waited for", and none follows while it applies, but its
    pulses keep coming. That last word is no evidence of a stall for the time after it
    (a loaded CI machine lost a worker so, in the middle of a pipelined MLP)."""
    async def main():
        manager, fleet, controller = _manager()
        worker = manager.register(register(slice_index=0, pid=45), lambda frame: None, "peer")
        fleet.mark_up(0)
        worker.send(c.Free((1,)))
        worker.flush()
        worker.on_message(m.Heartbeat({}, 0, 900, ""))  # a backlog, applied without a pause
        heard = worker.last_seen
        later = heard + manager.config.stall_timeout * 4
        worker.last_seen = later  # pulses: alive
        assert worker.stalled(later) == 0
        manager.judge(later)
        assert worker.lost is None
        # Heartbeats that go on saying the same, with no progress, are a stall.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(remote, "time", types.SimpleNamespace(monotonic=lambda: later))
            worker.on_message(m.Heartbeat({}, 0, 900, ""))
        assert worker.stalled(later + 1) == pytest.approx(later - heard)
        manager.judge(later)
        assert isinstance(worker.lost, errors.WorkerLost)
    run(main())


def test_a_worker_incident_is_logged_by_the_controller_with_its_log(caplog):
    async def main():
        manager, fleet, controller = _manager()
        reg = dataclasses.replace(register(slice_index=0, pid=44), log="/tmp/w.log")
        worker = manager.register(reg, lambda frame: None, "peer")
        manager.welcome(worker)
        worker.on_message(m.Incident("ERROR", "isthmus.worker.agent", "command Execute failed",
                                     "Traceback (most recent call last):\nRuntimeError: boom\n",
                                     dropped=3))
    with caplog.at_level("WARNING"):
        run(main())
    record = next(r for r in caplog.records if "command Execute failed" in r.getMessage())
    text = record.getMessage()
    assert record.levelname == "ERROR"
    assert "host:44 (slice 0, host 0)" in text and "its log: /tmp/w.log" in text
    assert "RuntimeError: boom" in text and "3 more errors" in text
