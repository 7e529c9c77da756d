"""The embedded backend's channel (`worker/inline.py`): commands apply at once and in
order, except behind a collective program that must wait for the ones in flight."""

import asyncio

import numpy as np
import pytest

from isthmus import errors
from isthmus.transport import commands as c
from isthmus.transport.base import Commands
from isthmus.transport.flow import FlowGate, FlowLimits
from isthmus.worker.inline import InlineOrder


class Host:
    """What `InlineOrder` uses of a `DeviceHost`; programs 1 must wait while `busy` holds."""

    def __init__(self):
        self.log = []
        self.busy = []  # arrays of collective programs still running
        self.waited = []
        self.collectives = self  # its collective programs in flight (`inline.Backlog`)

    def backlog(self, executable):
        return list(self.busy) if executable == 1 else []

    def wait_for(self, values):
        future = asyncio.get_running_loop().create_future()
        self.waited.append((values, future))
        return future

    def execute(self, executable, args, results, copy_first):
        self.log.append(("execute", int(executable)))

    def free(self, buffers):
        self.log.append(("free", tuple(buffers)))

    def fetch(self, buffer, nbytes):
        self.log.append(("fetch", buffer))
        if buffer < 0:
            raise errors.InvalidRequest("no such buffer")
        done = asyncio.get_running_loop().create_future()
        done.set_result(np.float32(buffer))
        return done


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_commands_apply_in_the_call_when_nothing_waits():
    async def main():
        host = Host()
        order = InlineOrder(host)
        order.send(c.Execute(1, (), (10,)))
        assert await order.ask(c.Fetch(10)) == 10
        order.deliver(Commands([c.Free((10,)), c.Execute(2, (), (20,))]))
        assert host.log == [("execute", 1), ("fetch", 10), ("free", (10,)), ("execute", 2)]
        assert order.waiting == 0
    run(main())


def test_a_collective_program_and_all_after_it_wait_for_the_ones_in_flight():
    async def main():
        host = Host()
        order = InlineOrder(host)
        host.busy = ["running"]
        order.send(c.Execute(1, (), (10,)))  # held: a collective over busy devices
        order.send(c.Execute(2, (), (20,)))  # not collective, but behind it
        answer = order.ask(c.Fetch(20))
        order.deliver(Commands([c.Free((10,))]))
        failed = order.ask(c.Fetch(-1))
        await asyncio.sleep(0.01)
        assert host.log == [] and order.waiting == 5
        assert host.waited[0][0] == ["running"]
        host.busy = []
        host.waited[0][1].set_result(None)
        assert await answer == 20
        with pytest.raises(errors.InvalidRequest, match="no such buffer"):
            await failed
        assert host.log == [("execute", 1), ("execute", 2), ("fetch", 20), ("free", (10,)),
                            ("fetch", -1)]
        assert order.waiting == 0
        order.send(c.Execute(1, (), (30,)))  # nothing in flight: at once again
        assert host.log[-1] == ("execute", 1)
    run(main())


def test_closing_fails_the_requests_still_held():
    async def main():
        host = Host()
        order = InlineOrder(host)
        host.busy = ["running"]
        order.send(c.Execute(1, (), (10,)))
        answer = order.ask(c.Fetch(10))
        await asyncio.sleep(0)
        order.close()
        with pytest.raises(errors.SessionClosed):
            await answer
        assert host.log == []
    run(main())


def test_a_long_backlog_closes_the_flow_gate_until_it_drains():
    async def main():
        host = Host()
        order = InlineOrder(host)
        gate = FlowGate(FlowLimits(high=3, low=2))
        order.attach_flow(gate, "embedded")
        host.busy = ["running"]
        order.send(c.Execute(1, (), (10,)))
        order.send(c.Free((1,)))
        assert gate.is_open
        order.send(c.Free((2,)))  # three held: clients wait
        assert not gate.is_open
        await asyncio.sleep(0)
        host.busy = []
        host.waited[0][1].set_result(None)
        await asyncio.wait_for(gate.wait(), 5)
        await asyncio.sleep(0.01)
        assert order.waiting == 0 and gate.is_open
    run(main())


def test_a_command_that_raises_fails_what_it_makes_and_the_next_ones_go_on():
    """The embedded backend refuses a command that raises as a worker does: its outputs
    hold the error (no reader waits on them) and later commands still apply (issue 36)."""
    class Faulty(Host):
        failed = {}

        def execute(self, executable, args, results, copy_first):
            if executable == 9:
                raise RuntimeError("a bug")
            super().execute(executable, args, results, copy_first)

        def fail_outputs(self, executable, results, error):
            for base in results:
                self.failed[base] = error

        def fail(self, buffer, error):
            self.failed[buffer] = error

    async def main():
        host = Faulty()
        order = InlineOrder(host)
        order.send(c.Execute(9, (1,), (20,)))
        order.send(c.Execute(2, (1,), (30,)))
        error = host.failed[20]
        assert isinstance(error, errors.InternalError)
        assert "RuntimeError: a bug" in error.message and "bug in isthmus" in error.message
        assert ("execute", 2) in host.log and 30 not in host.failed
        with pytest.raises(errors.InvalidRequest):
            await order.ask(c.Fetch(-1, 0))
    run(main())
