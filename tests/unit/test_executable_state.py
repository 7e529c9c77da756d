"""An executable's life in the controller (`controller.ExecutableState`): compiling, ready,
idle in the cache, failed, dropped; moved only along `MOVES`, and checked by
`validate_executables` as the ledger's records are by `validate_state`."""

import asyncio
import dataclasses

import numpy as np
import pytest

from isthmus import errors
from isthmus.controller.controller import Controller, ControllerConfig
from isthmus.controller.executables import MOVES, ExecutableState
from isthmus.controller.session_moves import ReshardPlan
from isthmus.head import embedded_fleet
from isthmus.transport.records import CompileRequest

S = ExecutableState


def _request(fn, *args):
    import jax

    from isthmus.compat import jax as jax_compat

    options = jax_compat.xla_client().CompileOptions().SerializeAsString()
    return CompileRequest(jax.jit(fn).lower(*args).as_text().encode(), options, (0,))


def _controller(cache=4):
    fleet, _ = embedded_fleet(1)
    return Controller(fleet, ControllerConfig(compile_cache_size=cache))


def test_every_state_has_its_moves_and_only_failed_and_dropped_are_final():
    assert set(MOVES) == set(S)
    assert {s for s, to in MOVES.items() if not to} == {S.FAILED, S.DROPPED}
    assert all(S.COMPILING not in to or s is S.IDLE for s, to in MOVES.items())


def test_compiled_released_kept_idle_taken_again_and_evicted():
    async def main():
        controller = _controller(cache=1)
        devices = controller.fleet.devices
        request = _request(lambda a: a + 1, np.float32(1))
        first = controller.executable(request, devices)
        assert first.state is S.COMPILING
        await first.compiled
        assert first.state is S.READY
        again = controller.executable(request, devices)  # a second session: the same one
        assert again is first and first.refs == 2
        controller.release_executable(first)
        controller.release_executable(first)
        assert first.state is S.IDLE
        controller.validate_executables()
        assert controller.executable(request, devices) is first and first.state is S.READY
        controller.release_executable(first)
        other = controller.executable(_request(lambda a: a * 2, np.float32(1)), devices)
        await other.compiled
        controller.release_executable(other)  # the cache keeps one: the older leaves
        assert (first.state, other.state) == (S.DROPPED, S.IDLE)
        controller.validate_executables()
        with pytest.raises(errors.InternalError, match="cannot go from dropped to ready"):
            first.move(S.READY)
    asyncio.run(main())


def test_released_while_compiling_stays_idle_and_a_private_plan_is_dropped():
    async def main():
        controller = _controller()
        devices = controller.fleet.devices
        request = _request(lambda a: a - 1, np.float32(1))
        executable = controller.executable(request, devices)
        controller.release_executable(executable)
        assert executable.state is S.IDLE
        await executable.compiled
        assert executable.state is S.IDLE  # compiled in the cache
        controller.validate_executables()
        plan = ReshardPlan((), (), False)
        private = controller.executable(plan, devices)
        assert private.state is S.READY  # nothing to compile on the hosts
        controller.release_executable(private)
        assert private.state is S.DROPPED
        controller.validate_executables()
    asyncio.run(main())


def test_a_failed_compile_is_neither_listed_nor_kept_idle():
    async def main():
        controller = _controller()
        devices = controller.fleet.devices
        bad = dataclasses.replace(_request(lambda a: a + 1, np.float32(1)),
                                  module=b"this is no program")
        executable = controller.executable(bad, devices)
        controller.release_executable(executable)  # released before the compile answered
        with pytest.raises(errors.IsthmusError):
            await executable.compiled
        assert executable.state is S.FAILED and executable.error is not None
        controller.validate_executables()  # neither listed nor idle
        retry = controller.executable(bad, devices)  # a later compile starts afresh
        assert retry is not executable and retry.state is S.COMPILING
        with pytest.raises(errors.IsthmusError):
            await retry.compiled
    asyncio.run(main())


def test_validate_finds_a_listed_executable_that_was_dropped():
    async def main():
        controller = _controller()
        executable = controller.executable(_request(lambda a: a, np.float32(1)),
                                           controller.fleet.devices)
        await executable.compiled
        executable.state = S.DROPPED  # as a move a bug forgot to unlist would leave it
        with pytest.raises(AssertionError, match="dropped but still listed"):
            controller.validate_executables()
    asyncio.run(main())


def test_specs_are_worked_out_once_when_the_compile_answers():
    async def main():
        controller = _controller()
        devices = controller.fleet.devices
        request = _request(lambda a, b: (a + b, a * 2), np.float32(1), np.zeros(3, np.float32))
        executable = controller.executable(request, devices)
        assert executable.param_specs is None and executable.output_specs is None
        await executable.compiled
        params, outputs = executable.param_specs, executable.output_specs
        assert [p.memory_kind for p in params] == [devices[0].memory_kinds[0]] * 2
        assert [tuple(o.aval.shape) for o in outputs] == [(3,), ()]
        assert all(o.origin is not None for o in outputs)  # small: read ahead when asked
        again = controller.executable(request, devices)
        assert again.param_specs is params and again.output_specs is outputs

    asyncio.run(main())
