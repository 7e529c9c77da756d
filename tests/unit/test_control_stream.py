"""The workers' control stream (transport/frames.py, wire/fleet_service.py) over a real
socket on 127.0.0.1: frames keep their boundaries whatever their size, a stream that does
not start with Register is refused with a reason, a refused worker hears why, and a worker
whose stream closes is lost."""

import asyncio

from isthmus.controller.controller import Controller
from isthmus.controller.fleet import Fleet
from isthmus.controller.manager import FleetManager, FleetSpec
from isthmus.transport import messages as m
from isthmus.transport.frames import StreamClosed, read_frame, write_frame
from isthmus.wire.fleet_service import FleetServicer


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 20))


def register(slice_index=0, devices=2, pid=1):
    return m.Register(m.PROTOCOL_VERSION, slice_index, devices, "cpu", "cpu", "127.0.0.1:1",
                      "host", pid)


async def _service():
    fleet = Fleet([], {})
    controller = Controller(fleet)
    manager = FleetManager(FleetSpec(slices=1, hosts_per_slice=1, devices_per_host=2), fleet,
                           on_slice_down=controller.poison_slice)
    service = FleetServicer(manager)
    port = await service.start("127.0.0.1")
    return service, manager, fleet, port


def test_frames_keep_their_boundaries_and_the_end_is_stream_closed():
    async def main():
        got = []

        async def serve(reader, writer):
            try:
                while True:
                    got.append(await read_frame(reader))
            except StreamClosed:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent = [b"", b"a", bytes(range(256)) * 300, b"z" * (9 << 20)]  # small, large, empty
        for payload in sent:
            write_frame(writer, payload)
        writer.close()
        await writer.wait_closed()
        for _ in range(200):
            if len(got) == len(sent):
                break
            await asyncio.sleep(0.05)
        assert got == sent
        server.close()
    run(main())


def test_a_stream_that_does_not_register_is_refused_and_a_registered_one_is_welcomed():
    async def main():
        service, manager, fleet, port = await _service()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        write_frame(writer, b"not a message")
        answer = m.decode(await read_frame(reader))
        assert isinstance(answer, m.Refused) and "must start with Register" in answer.reason
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        write_frame(writer, m.encode(register(devices=3)))  # the fleet has 2 per host
        answer = m.decode(await read_frame(reader))
        assert isinstance(answer, m.Refused) and "--devices 2" in answer.reason
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        write_frame(writer, m.encode(register()))
        welcome = m.decode(await read_frame(reader))
        assert isinstance(welcome, m.Welcome) and welcome.worker == 0
        assert fleet.workers[0].lost is None
        writer.close()  # the worker goes away: its slot is lost
        for _ in range(100):
            if fleet.workers.get(0) is None or fleet.workers[0].lost is not None:
                break
            await asyncio.sleep(0.05)
        assert fleet.workers.get(0) is None or fleet.workers[0].lost is not None
        assert fleet.slice_error(0) is not None
        await service.stop()
    run(main())
