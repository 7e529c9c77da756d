"""Each worker command is one record (`transport/commands.py`): it travels in the fleet's codec
as it is, and its handling calls a method the host has. Every channel takes commands the
same way: the in-process host applies them, a lost worker's stand-in drops or fails them."""

import asyncio
import inspect
import operator

import numpy as np
import pytest

from isthmus import errors
from isthmus.controller.fleet import LostChannel
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.base import Commands
from isthmus.transport.records import ColocatedProgram, CompileRequest, TraceOptions
from isthmus.worker.host import DeviceHost, make_cpu_client

BOX = ((0, 2), (0, 3))

# One of each command: a command added without a sample here fails the first test.
SAMPLES = {
    c.Put: c.Put(1, 0, np.zeros(3, np.float32), None),
    c.Fail: c.Fail(1, errors.ExecutionError("broke")),
    c.Copy: c.Copy(1, 2, 0, "pinned_host"),
    c.Pull: c.Pull(1, "127.0.0.1:9", 2, 0, None),
    c.Assemble: c.Assemble(2, 0, None, "float32", (2, 3),
                           ((1, (slice(0, 2), slice(0, 3)), (slice(0, 2), slice(0, 3))),)),
    c.Bitcast: c.Bitcast(1, 2, "int32", (3,)),
    c.Free: c.Free(range(4, 8)),
    c.Ready: c.Ready((1, 2)),
    c.Fetch: c.Fetch(1, 12),
    c.DefaultLayout: c.DefaultLayout("float32", (512, 10), 0),
    c.Held: c.Held(),
    c.ProgramText: c.ProgramText(3),
    c.CostAnalysis: c.CostAnalysis(3),
    c.Compile: c.Compile(3, CompileRequest(b"mlir", b"options", (0, 1), 1, "team")),
    c.Load: c.Load(3, ColocatedProgram("f", b"pickle", (0,), ((0,),), ((0,),),
                                       (("float32", (4,)),))),
    c.DropExecutable: c.DropExecutable(3),
    c.Refuse: c.Refuse(3, (0, 1), errors.ProgramRefused("crashed a worker")),
    c.Execute: c.Execute(3, (7, (8, 9)), (10,), frozenset({1})),
    c.CallPython: c.CallPython(3, (7,), (10,), (1, 2)),
    c.WriteShards: c.WriteShards("/tmp/x", ((1, BOX),)),
    c.WriteMeta: c.WriteMeta("/tmp/x", "float32", (2, 3), (BOX,)),
    c.ReadShards: c.ReadShards("/tmp/x", "float32", (2, 3), ((1, 0, BOX),)),
    c.StartProfile: c.StartProfile("t1", TraceOptions(2, 0, (("gpu_max_events", 9),))),
    c.StopProfile: c.StopProfile("t1", "/tmp/p", "host0"),
}


def _command_classes():
    return [cls for _, cls in inspect.getmembers(c, inspect.isclass)
            if issubclass(cls, c.Command) and cls not in (c.Command, c.Request)]


def test_every_command_has_a_sample_and_is_exported():
    for cls in _command_classes():
        assert cls in SAMPLES, f"add a sample of {cls.__name__} to SAMPLES"
        assert cls.__name__ in c.__all__, f"{cls.__name__} is missing from commands.__all__"


class Recorder:
    """A host that records which of its methods (or its parts' methods) a command calls."""

    def __init__(self, called=None, path=""):
        self.called = [] if called is None else called
        self.path = path

    def __getattr__(self, name):
        return Recorder(self.called, f"{self.path}.{name}" if self.path else name)

    def __call__(self, *args):
        self.called.append(self.path)


@pytest.fixture(scope="module")
def real_host():
    host = DeviceHost(make_cpu_client(1))
    yield host
    asyncio.run(host.close())


@pytest.mark.parametrize("cls", _command_classes(), ids=lambda cls: cls.__name__)
def test_a_command_travels_as_itself_and_calls_a_method_of_the_host(cls, real_host):
    command = SAMPLES[cls]
    back = m.decode(m.encode(m.Ask(1, command) if isinstance(command, c.Request)
                             else m.Batch((command,))))
    back = back.command if isinstance(command, c.Request) else back.commands[0]
    if isinstance(command, (c.Fail, c.Refuse)):  # errors compare by class and message
        assert type(back.error) is type(command.error)
        assert back.error.message == command.error.message
    elif isinstance(command, c.Put):  # arrays compare element by element
        assert (back.buffer, back.device, back.memory_kind) == (1, 0, None)
        assert back.value.dtype == command.value.dtype
        np.testing.assert_array_equal(back.value, command.value)
    else:
        assert back == command
    host = Recorder()
    if cls is c.Pull:  # only a worker process has peers: its agent pulls
        with pytest.raises(errors.InternalError, match="no peers"):
            command.apply(host)
        return
    command.apply(host)
    assert len(host.called) == 1, host.called
    try:
        method = operator.attrgetter(host.called[0])(real_host)
    except AttributeError:
        method = None
    assert callable(method), (
        f"{cls.__name__}.apply calls DeviceHost.{host.called[0]}, which does not exist")


def test_produces_names_the_buffers_a_command_makes():
    assert SAMPLES[c.Copy].produces() == (2,)
    assert SAMPLES[c.Assemble].produces() == (2,)
    assert SAMPLES[c.ReadShards].produces() == (1,)
    assert SAMPLES[c.Execute].produces() == ()  # it fails its own outputs
    assert SAMPLES[c.Fetch].produces() == ()


def test_a_string_array_keeps_its_dtype_in_an_assemble():
    assert c.dtype_field(None) is None and c.dtype_field(object) is None
    assert c.dtype_field(np.float32) == "float32"
    command = c.Assemble(2, 0, None, c.dtype_field(object), (2,),
                         ((1, (slice(0, 2),), (slice(0, 2),)),))
    host = Recorder()
    calls = []
    host.assemble = lambda *args: calls.append(args)
    command.apply(host)
    assert calls[0][3] is None  # not float64, as a dtype of None once became


def test_the_in_process_host_takes_commands_like_a_channel():
    async def main():
        host = DeviceHost(make_cpu_client(2))
        value = np.arange(6, dtype=np.float32).reshape(2, 3)
        await host.ask(c.Put(1, 0, value))
        host.send(c.Copy(1, 2, 1, None))
        host.deliver(Commands([c.Bitcast(2, 3, "int32", (6,)), c.Free((1,))]))
        np.testing.assert_array_equal(await host.ask(c.Fetch(2)), value)
        np.testing.assert_array_equal(await host.ask(c.Fetch(3)),
                                      value.view(np.int32).reshape(6))
        assert not host.has(1)
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_lost_worker_drops_what_is_sent_and_fails_what_is_asked():
    async def main():
        lost = LostChannel(errors.WorkerLost("worker 3 is gone"))
        lost.send(SAMPLES[c.Execute])
        lost.deliver(Commands([SAMPLES[c.Free]]))
        assert lost.stats() == {}
        for request in (SAMPLES[c.Fetch], SAMPLES[c.Compile], SAMPLES[c.Put]):
            with pytest.raises(errors.WorkerLost, match="worker 3 is gone"):
                await lost.ask(request)
    asyncio.run(asyncio.wait_for(main(), 10))
