"""The device side run in-process: what a worker answers without a thread hand-off."""

import asyncio
import dataclasses

import numpy as np
import pytest

from isthmus import errors
from isthmus.worker.host import DeviceHost, make_cpu_client


def test_all_ready_only_for_present_computed_error_free_buffers():
    async def main():
        host = DeviceHost(make_cpu_client(1))
        await host.put(1, 0, np.arange(4, dtype=np.float32))
        await host.ready([1])
        assert host.all_ready([1])
        host.fail(2, errors.ExecutionError("it broke"))
        assert not host.all_ready([1, 2])  # the slow path reports the error
        assert not host.all_ready([3])  # not (yet) here
        host.free([1])
        assert not host.all_ready([1])
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_collective_that_lost_a_peer_is_data_loss_not_an_execution_error():
    from isthmus import errors
    from isthmus.worker.host import computation_error

    gloo = RuntimeError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
                        "pair.cc:538] Read error [127.0.0.1]:31468: Connection reset by peer")
    error = computation_error(gloo)
    assert isinstance(error, errors.PeerFailure) and error.code == errors.Code.DATA_LOSS
    assert "lost a peer of its collective group" in error.message
    assert "Connection reset by peer" in error.message
    other = computation_error(RuntimeError("INVALID_ARGUMENT: shapes do not match"))
    assert type(other) is errors.ExecutionError and other.code == errors.Code.INVALID_ARGUMENT
    assert errors.is_peer_failure("NCCL operation ncclAllReduce failed: remote process exited")
    assert not errors.is_peer_failure("RESOURCE_EXHAUSTED: out of memory")


def test_small_puts_give_what_jax_device_put_gives():
    import jax
    import ml_dtypes

    async def main():
        host = DeviceHost(make_cpu_client(2))
        base = np.arange(24, dtype=np.float64).reshape(4, 6)
        values = [base, base.astype(np.int64), base.astype(np.float32)[:, ::2],  # strided
                  base.T, base.astype(ml_dtypes.bfloat16), (base % 8).astype(ml_dtypes.int4),
                  base > 5, base.astype(np.complex64), np.float32(7.5).reshape(()),
                  np.zeros((0, 3), np.int8), base.astype(np.uint16)]
        for i, value in enumerate(values):
            await host.put(i, i % 2, value)
            stored = host.buffers.slot(i)
            want = jax.device_put(value, host.devices[i % 2])
            assert stored.dtype == value.dtype == want.dtype, (i, stored.dtype)
            assert stored.shape == value.shape and stored.devices() == want.devices()
            np.testing.assert_array_equal(np.asarray(stored), value)
        from jax.sharding import SingleDeviceSharding

        device = host.devices[1]
        for i, kind in enumerate(m.kind for m in device.addressable_memories()):
            await host.put(50 + i, 1, base, kind)
            stored = host.buffers.slot(50 + i)
            want = jax.device_put(base, SingleDeviceSharding(device, memory_kind=kind))
            assert stored.sharding == want.sharding and stored.sharding.memory_kind == kind
            np.testing.assert_array_equal(np.asarray(stored), base)
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_colocated_cpu_devices_hold_copies_reshards_and_programs(monkeypatch):
    """A host with a second client for its colocated CPU devices (an accelerator host's),
    global ids 100 and 101 beside 0 and 1: copies between the two clients and reshards from
    both (programs on them: tests/integration/test_colocated_accelerators.py)."""
    import jax

    async def main():
        cpu = make_cpu_client(2)
        host = DeviceHost(make_cpu_client(2), companions={100: cpu.local_devices()[0],
                                                          101: cpu.local_devices()[1]})
        assert host.local_positions([0, 1, 100, 101]) == (0, 1, 2, 3)
        await host.put(1, 0, np.arange(4.0))
        host.copy(1, 2, 100)  # accelerator -> its CPU device
        assert next(iter(host.buffers.slot(2).devices())) is cpu.local_devices()[0]
        host.copy(2, 3, 1)  # and to another accelerator
        host.assemble(4, 101, None, np.dtype(np.float64), (8,),
                      [(1, (slice(0, 4),), (slice(0, 4),)), (3, (slice(0, 4),), (slice(4, 8),))])
        np.testing.assert_array_equal(await host.fetch(4), np.concatenate([np.arange(4.0)] * 2))
        # Where the plugin refuses copies across clients, they go through numpy.
        real, refused = jax.device_put, []

        def refusing(value, target, **kwargs):
            (device,) = target.device_set
            if next(iter(value.devices())).client is not device.client:
                refused.append(device)
                raise RuntimeError("cross-client copies are not supported")
            return real(value, target, **kwargs)

        monkeypatch.setattr(jax, "device_put", refusing)
        host.copy(4, 5, 0)
        np.testing.assert_array_equal(await host.fetch(5), await host.fetch(4))
        assert refused and next(iter(host.buffers.slot(5).devices())) is host.devices[0]
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def _sum_step(devices: int, n: int):
    """A program over `devices` CPU devices: x + sum(tanh(x)^2), a cross-device sum, its
    input donated (a training step's shape)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from isthmus.compat import jax as jax_compat
    from isthmus.transport.records import CompileRequest

    xc = jax_compat.xla_client()
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:devices]), ("x",)), P("x"))
    lowered = jax.jit(lambda x: x + jnp.sum(jnp.tanh(x) ** 2), donate_argnums=0,
                      in_shardings=sharding, out_shardings=sharding).lower(
        jax.ShapeDtypeStruct((n,), np.float32))
    options = xc.CompileOptions()
    options.num_partitions = devices
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = jax.config.jax_use_shardy_partitioner
    return CompileRequest(lowered.as_text().encode(), options.SerializeAsString(),
                          tuple(range(devices)))


def test_a_step_donating_the_output_of_a_running_collective_step_runs_after_it():
    """Issue 36: `x = f(x)` over several devices with a cross-device sum, its input donated,
    never waiting. Each step donates the shards of the step before while that one may still
    run (jaxlib marks them deleted); every step must run, in order, with the right values,
    and the host's rules for collective programs must not trip over the deleted shards."""
    devices, n, steps = 4, 1 << 18, 12

    async def main():
        host = DeviceHost(make_cpu_client(devices))
        x = np.linspace(-1, 1, n, dtype=np.float32)
        for p, part in enumerate(np.split(x, devices)):
            await host.put(100 + p, p, part)
        info = await host.compile(7, _sum_step(devices, n))
        assert info.donated_inputs == (0,)
        want = x.astype(np.float64)
        for step in range(steps):
            host.execute(7, [100 * (step + 1)], [100 * (step + 2)])  # no wait between
            want = want + np.sum(np.tanh(want.astype(np.float32)).astype(np.float64) ** 2)
            host.buffers.validate_state()
        last = 100 * (steps + 1)
        got = np.concatenate([await host.fetch(last + p) for p in range(devices)])
        np.testing.assert_allclose(got, want, rtol=1e-4)
        for p in range(devices):  # donated inputs read as deleted, never as "not here"
            with pytest.raises(errors.ArrayDeleted):
                host.buffers.value(100 * steps + p)
        host.collectives.drop_finished()
        assert not host.collectives.failed
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 120))


def _request(fn, *args, donate=()):
    import jax

    from isthmus.compat import jax as jax_compat
    from isthmus.transport.records import CompileRequest

    xc = jax_compat.xla_client()
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    return CompileRequest(lowered.as_text().encode(), xc.CompileOptions().SerializeAsString(),
                          (0,))


def test_only_donations_the_compiled_program_uses_are_reported():
    """PjRt consumes an offered buffer only when XLA aliased it to an output: `x @ x.T`
    cannot reuse `x` (jax's pjit_test testBufferDonationNotDonated), `y + 1` can."""
    import jax

    async def main():
        host = DeviceHost(make_cpu_client(1))
        x, y = jax.ShapeDtypeStruct((4, 3), np.float32), jax.ShapeDtypeStruct((3,), np.float32)
        info = await host.compile(1, _request(lambda a, b: (a @ a.T, b + 1), x, y,
                                              donate=(0, 1)))
        assert info.donated_inputs == (1,)
        await host.close()
    with pytest.warns(UserWarning, match="donated buffers were not usable"):
        asyncio.run(asyncio.wait_for(main(), 60))


def test_text_and_cost_are_worked_out_when_asked_not_at_the_compile(monkeypatch):
    """A compile prints no text (11 ms a program of a language model on a TPU) unless some
    parameter only offers its buffer; the text and XLA's cost analysis, asked later, are
    local jax's."""
    import jax
    import jax.numpy as jnp

    from isthmus.worker import programs

    def printed(*args):
        raise AssertionError("the compile printed the program")

    fn = lambda a, b: (jnp.tanh(a @ b), b * 2)  # noqa: E731
    x, y = jax.ShapeDtypeStruct((8, 16), np.float32), jax.ShapeDtypeStruct((16, 16), np.float32)
    compiled = jax.jit(fn, donate_argnums=1).lower(x, y).compile()

    async def main():
        host = DeviceHost(make_cpu_client(1))
        with monkeypatch.context() as patch:
            patch.setattr(programs, "compiled_donations", printed)
            info = await host.compile(1, _request(fn, x, y, donate=(1,)))
        assert info.donated_inputs == (1,)  # named its output: nothing to print for
        text, cost = await host.program_text(1), await host.cost_analysis(1)
        assert "dot" in text and text.startswith("HloModule ")
        assert cost["flops"] == compiled.cost_analysis()["flops"] > 0
        with pytest.raises(errors.InternalError, match="not a program compiled on this host"):
            await host.program_text(2)
        bad = dataclasses.replace(_request(fn, x, y), module=b"not a program")
        with pytest.raises(errors.CompileError):
            await host.compile(3, bad)
        with pytest.raises(errors.CompileError):
            await host.cost_analysis(3)  # its compile's error, again
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_program_with_token_parameters_and_outputs_says_why_it_has_no_layouts():
    """XLA:CPU has no layouts for tokens; jax falls back to default layouts when the
    backend says so (UNIMPLEMENTED), and must not get empty lists instead."""
    import jax

    async def main():
        host = DeviceHost(make_cpu_client(1))
        fn, args = (lambda t, v: (t, v + 1)), (jax.lax.create_token(),
                                                 jax.ShapeDtypeStruct((), np.float32))
        info = await host.compile(1, _request(fn, *args))
        local = jax.jit(fn).lower(*args).compile().runtime_executable()
        for query, layouts, error in [
                (local.get_parameter_layouts, info.param_layouts, info.param_layouts_error),
                (local.get_output_layouts, info.output_layouts, info.output_layouts_error)]:
            try:  # what the local client answers (jaxlib 0.10 raises; later ones answer)
                want, why = tuple(str(x) for x in query()), ""
            except Exception as e:  # noqa: BLE001
                want, why = (), str(e).splitlines()[0]
            assert (layouts, error) == (want, why)
        plain = await host.compile(2, _request(lambda v: v + 1,
                                               jax.ShapeDtypeStruct((3,), np.float32)))
        assert plain.output_layouts == ("{0}",) and not plain.output_layouts_error
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_worker_hosts_are_type_checked_as_command_hosts():
    """mypy, in `scripts/test`'s lint, checks that the worker's hosts are what commands are
    applied to (`CommandHost`; the worker layer is outside the server's mypy run): through
    tests/typechecks/command_hosts.py, which must stay among mypy's files. (Until 2026-12-08
    this test ran mypy itself, 12-23 s of each environment's run.)"""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).parents[2]
    files = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert "tests/typechecks" in files
    check = (root / "tests/typechecks/command_hosts.py").read_text()
    assert "-> list[CommandHost]" in check and "[device, simulated]" in check


def test_a_colocated_call_whose_input_failed_fails_with_the_inputs_error():
    """An input whose computation failed (a peer lost in its collective) is the call's
    error as it is the input's: DATA_LOSS naming the lost peer, not "a bug in isthmus"."""
    import jax

    from isthmus.transport.records import ColocatedProgram
    from isthmus.worker import colocated

    class LostInCollective:  # a shard whose computation failed after it was dispatched
        def block_until_ready(self):
            raise RuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset by peer")

    device = jax.devices()[0]
    program = ColocatedProgram("load_batch", b"", (0,), ((0,),), ((0,),), (("float32", (2,)),))
    called = []
    function = colocated.PythonFunction(
        program, lambda x: called.append(x), jax.tree_util.tree_structure(0), (None,),
        ((0,),), ((0,),), frozenset({device}))
    with pytest.raises(errors.PeerFailure) as caught:
        colocated.run(function, {0: device}, [[LostInCollective()]])
    assert caught.value.code == errors.Code.DATA_LOSS and "Connection reset" in str(caught.value)
    assert not called  # the user's function never saw the broken input


def test_a_re_formation_waits_for_shards_being_read_from_a_checkpoint(monkeypatch):
    """A new collective group adopts the host's buffers once `settle_writes` returns: shards
    still being read then must land first, or the new group never sees them (the client's
    read of a restored array found its buffer on no host)."""
    import threading

    from isthmus.worker import persistence

    release = threading.Event()

    def slow_read(location, dtype, shape, box):
        assert release.wait(30)
        return np.arange(4, dtype=dtype)

    monkeypatch.setattr(persistence, "read_box", slow_read)

    async def main():
        host = DeviceHost(make_cpu_client(1))
        reading = host.checkpoints.read_shards("/unused", "float32", (4,), [(7, 0, ((0, 4),))])
        settled = asyncio.ensure_future(host.settle_writes())
        await asyncio.sleep(0.2)
        assert not settled.done()  # the read is still going: no adoption yet
        release.set()
        await settled
        await reading
        np.testing.assert_array_equal(np.asarray(host.buffers.value(7)), np.arange(4))
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_fetch_copied_in_a_thread_answers_later_and_keeps_the_order_of_donations():
    """The embedded server of an accelerator (`copy_inline` False) starts a computed buffer's
    copy and answers from a thread: the fetch is not answered in the call, gives the same
    data, counts as a read in flight (a program donating the buffer afterwards donates a
    copy), and reports a failed buffer's error."""
    async def main():
        host = DeviceHost(make_cpu_client(1))
        host.reads.copy_inline = False
        info = await host.compile(1, _request(lambda a: a * 2, np.ones(4, np.float32),
                                              donate=(0,)))
        assert info.donated_inputs == (0,)
        await host.put(10, 0, np.arange(4, dtype=np.float32))
        await host.ready([10])
        fetched = host.fetch(10)
        assert not asyncio.isfuture(fetched) or not fetched.done()  # a thread answers it
        assert 10 in host.reads.in_flight
        host.execute(1, [10], [11])  # donates 10 after the read: a copy goes in
        np.testing.assert_array_equal(await fetched, np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(await host.fetch(11), np.arange(4, dtype=np.float32) * 2)
        assert not host.reads.in_flight
        host.fail(12, errors.ExecutionError("it broke"))
        with pytest.raises(errors.ExecutionError, match="it broke"):
            await host.fetch(12)
        host.reads.copy_inline = True  # a worker's: a computed buffer answered in the call
        done = host.fetch(11)
        assert asyncio.isfuture(done) and done.done()
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_one_device_run_with_an_unusable_argument_fails_its_outputs_with_why():
    """A program on one device takes its arguments unchecked (`BufferStore.slots_of`):
    jaxlib refuses a donated array or a failed slot before it runs anything, and the
    outputs then hold the argument's own error (the donation, the failure, the absence),
    as they did when every argument was checked first; the refused run donates nothing."""
    async def main():
        host = DeviceHost(make_cpu_client(1))
        await host.compile(1, _request(lambda a, b: (a * 2, b + 1), np.ones(4, np.float32),
                                       np.ones(4, np.float32), donate=(0, 1)))
        for buffer_id, value in ((10, np.arange(4)), (20, np.ones(4)), (21, np.ones(4))):
            await host.put(buffer_id, 0, value.astype(np.float32))
        host.execute(1, [10, 20], [30, 40])  # donates 10 and 20
        np.testing.assert_array_equal(await host.fetch(30), np.arange(4) * 2)
        host.execute(1, [10, 21], [31, 41])
        for out in (31, 41):
            with pytest.raises(errors.ArrayDeleted, match="donated"):
                await host.fetch(out)
        assert not host.buffers.value(21).is_deleted()  # not donated by the refused run
        host.fail(50, errors.ExecutionError("its producer broke"))
        host.execute(1, [30, 50], [32, 42])
        with pytest.raises(errors.ExecutionError, match="its producer broke"):
            await host.fetch(42)
        assert not host.buffers.value(30).is_deleted()
        host.execute(1, [30, 99], [33, 43])
        with pytest.raises(errors.InternalError, match="buffer 99 is not on this host"):
            await host.fetch(33)
        host.execute(1, [30, 21], [34, 44])  # the arguments still serve
        np.testing.assert_array_equal(await host.fetch(34), np.arange(4) * 4)
        np.testing.assert_array_equal(await host.fetch(44), np.full(4, 2.0))
        host.buffers.validate_state()
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))
