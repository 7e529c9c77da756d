"""The simulated accelerator in-process: the first call is real, later calls take their
FLOPs / rate of wall time on their device and are computed from nothing. Only lower bounds
on time are asserted (a sleep is never shorter than asked; a real run of these programs
takes microseconds)."""

import asyncio
import time

import numpy as np
import pytest

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.transport.records import CompileRequest
from isthmus.worker.host import make_cpu_client
from isthmus.worker.simulated import SimulatedHost, make_host

N = 64
FLOPS = 2 * N ** 3  # one N x N matmul
SECONDS = 0.25  # of each simulated run


def _program() -> CompileRequest:
    import jax
    import jax.numpy as jnp
    xc = jax_compat.xla_client()
    lowered = jax.jit(lambda x: jnp.tanh(x @ x)).lower(
        jax.ShapeDtypeStruct((N, N), np.float32))
    return CompileRequest(lowered.as_text().encode(), xc.CompileOptions().SerializeAsString(),
                          (0,))


def _host() -> SimulatedHost:
    return SimulatedHost(make_cpu_client(1), flops_per_s=FLOPS / SECONDS)


def test_later_calls_take_their_device_time_one_after_another_and_no_cpu():
    async def main():
        host = _host()
        x = np.eye(N, dtype=np.float32) * 0.5
        await host.put(1, 0, x)
        await host.compile(7, _program())
        assert (await host.cost_analysis(7))["flops"] >= FLOPS
        host.execute(7, [1], [10])  # the real run
        first = await host.fetch(10)
        np.testing.assert_allclose(first, np.tanh(x @ x), rtol=1e-6)
        began = time.monotonic()
        host.execute(7, [10], [20])
        host.execute(7, [20], [30])  # waits for the first on the same device
        dispatched = time.monotonic() - began
        if dispatched < SECONDS:
            assert not host.all_ready([20]) and not host.all_ready([30])
        await host.ready([30])
        assert time.monotonic() - began >= 2 * SECONDS * 0.999
        assert host.all_ready([20, 30])
        # Results are the first call's again: right shape and dtype, wrong values.
        later = await host.fetch(30)
        assert later.shape == (N, N) and later.dtype == np.float32
        np.testing.assert_array_equal(later, first)
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_what_is_made_from_a_simulated_output_is_not_ready_before_it():
    async def main():
        host = _host()
        await host.put(1, 0, np.ones((N, N), np.float32))
        await host.compile(7, _program())
        host.execute(7, [1], [10])
        await host.ready([10])
        began = time.monotonic()
        host.execute(7, [10], [20])
        host.copy(20, 21, 0, "pinned_host")
        host.bitcast(20, 22, np.dtype(np.int32), (N, N))
        host.assemble(23, 0, None, np.dtype(np.float32), (N // 2, N),
                      [(20, (slice(0, N // 2), slice(0, N)), (slice(0, N // 2), slice(0, N)))])
        if time.monotonic() - began < SECONDS:
            assert not any(host.all_ready([b]) for b in (21, 22, 23))
        await host.ready([21, 22, 23])
        assert time.monotonic() - began >= SECONDS * 0.999
        value = await host.fetch(20)
        np.testing.assert_array_equal(await host.fetch(21), value)
        np.testing.assert_array_equal(await host.fetch(22), value.view(np.int32))
        np.testing.assert_array_equal(await host.fetch(23), value[:N // 2])
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_failed_input_fails_the_outputs_and_nothing_is_consumed():
    async def main():
        host = _host()
        await host.put(1, 0, np.ones((N, N), np.float32))
        await host.compile(7, _program())
        host.execute(7, [1], [10])
        host.execute(7, [10], [20])
        host.fail(2, errors.ExecutionError("the input broke"))
        host.execute(7, [2], [30])
        with pytest.raises(errors.ExecutionError, match="the input broke"):
            await host.ready([30])
        await host.ready([1, 10, 20])  # nothing was consumed
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_make_host_simulates_only_when_asked():
    from isthmus.worker.host import DeviceHost
    from isthmus.worker.platforms import Platform

    client = make_cpu_client(1)
    assert type(make_host(client)) is DeviceHost
    assert isinstance(make_host(client, simulate_flops=1e12), SimulatedHost)
    with pytest.raises(ValueError, match="simulate-flops"):
        Platform(simulate_flops=-1.0)
