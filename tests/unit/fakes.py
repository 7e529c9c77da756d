"""Stand-ins the controller's unit tests share: a fleet that only records the frees sent
(`FakeFleet`, for the ledger) and a worker channel that keeps its frames and answers at once
(`Host`, over the real `RemoteWorker`)."""

from isthmus import dtypes
from isthmus.controller.arrays import Array
from isthmus.controller.fleet import Device
from isthmus.controller.sharding import Sharding, ShardingKind
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.transport import commands as c
from isthmus.transport import messages as m
from isthmus.transport.frames import Parts, Tailed
from isthmus.transport.records import Aval, CompiledInfo
from isthmus.transport.remote import RemoteWorker

F32 = dtypes.BY_KIND["KIND_F32"]
HOSTS = 3  # the hosts `Host` compiles for: one device each
DEVICES = tuple(Device(DeviceId(i), WorkerId(i // 2), i % 2, "cpu", "cpu", SliceId(i // 2), 0)
                for i in range(4))


class Channel:
    local = False  # a worker process's, as far as the controller can tell

    def __init__(self, sent, worker):
        self.sent, self.worker = sent, worker

    def send(self, command):
        self.sent.append((self.worker, command))


class FakeFleet:
    """The ledger's view of a fleet: it only records the frees sent."""

    workers = (WorkerId(0), WorkerId(1))

    def __init__(self):
        self.sent = []

    def worker_set(self, workers):
        return tuple(sorted(set(workers)))

    def multicast(self, workers, command):
        self.sent.append((workers, command))  # one shared command for all of them

    def channel(self, worker):
        return Channel(self.sent, worker)

    def freed(self):
        """Buffer ids freed so far (each must be freed once)."""
        ids = [i for _, command in self.sent if isinstance(command, c.Free)
               for i in command.buffers]
        assert len(ids) == len(set(ids)), f"a buffer was freed twice: {ids}"
        return set(ids)


def hold_array(ledger, devices=DEVICES, definers=0):
    group = ledger.new_group(devices, (16,) * len(devices), definers=definers)
    sharding = Sharding(ShardingKind.OPAQUE, tuple(d.id for d in devices))
    return ledger.hold(Array(F32, (4 * len(devices),), sharding, group))


class Host(RemoteWorker):
    """A worker channel whose stream keeps its frames; requests are answered at once."""

    def __init__(self, slot):
        self.frames = []
        register = m.Register(m.PROTOCOL_VERSION, 0, 1, "cpu", "cpu", "peer:0", "host", slot)
        super().__init__(slot, register, self.frames.append, "peer:0")

    def commands(self):
        out = []
        for frame in self.frames:
            if isinstance(frame, Parts):  # bulk bytes (a put's data) beside the message
                frame = Tailed(frame[0][8:], memoryview(b"".join(frame[1:])))
            for command in m.decode(frame).commands:
                out.extend(m.decode(command.data) if isinstance(command, m.Shared)
                           else [command])
        return out

    async def _answer(self, value):
        return value

    def ask(self, request):
        if isinstance(request, c.Compile):
            aval = Aval(F32, (HOSTS,))
            return self._answer(CompiledInfo(
                name="p", params=(aval,), outputs=(aval,), param_shardings=None,
                output_shardings=None, param_layouts=("{0}",), output_layouts=("{0}",),
                output_memory_kinds=("device",), donated_inputs=(), fingerprint=None,
                memory_stats={}, generated_code_bytes=0))
        if isinstance(request, c.Put):
            return self._answer(None)
        return super().ask(request)
