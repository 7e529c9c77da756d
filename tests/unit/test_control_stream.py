"""The workers' control stream (transport/frames.py, transport/auth.py,
wire/fleet_service.py) over a real socket on 127.0.0.1: frames keep their boundaries whatever
their size; a stream that does not prove the fleet's token is dropped before anything of it
is decoded, and a worker learns when the controller does not know its token; a stream that
does not start with Register is refused with a reason, a refused worker hears why, and a
worker whose stream closes is lost."""

import asyncio

import pytest

from isthmus.controller.controller import Controller
from isthmus.controller.fleet import WholeFleet
from isthmus.controller.manager import FleetManager, FleetSpec
from isthmus.transport import auth
from isthmus.transport import messages as m
from isthmus.transport.frames import StreamClosed, connect, read_frame, serve, write_frame
from isthmus.wire.fleet_service import FleetServicer


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 20))


def register(slice_index=0, devices=2, pid=1):
    return m.Register(m.PROTOCOL_VERSION, slice_index, devices, "cpu", "cpu", "127.0.0.1:1",
                      "host", pid)


TOKEN = "the fleet's secret"


async def _service(token=TOKEN):
    fleet = WholeFleet([], {})
    controller = Controller(fleet)
    manager = FleetManager(FleetSpec(slices=1, hosts_per_slice=1, devices_per_host=2), fleet,
                           on_slice_down=controller.ledger.poison_slice)
    service = FleetServicer(manager, token)
    port = await service.start("127.0.0.1")
    return service, manager, fleet, port


async def _connect(port, token=TOKEN):
    """A worker's stream, past the handshake."""
    reader, writer = await _open(port)
    await auth.prove_worker(reader, writer, token)
    return reader, writer


async def _open(port):
    stream = await connect("127.0.0.1", port)
    return stream, stream


def test_frames_keep_their_boundaries_and_the_end_is_stream_closed():
    async def main():
        got = []

        async def read(stream):
            try:
                while True:
                    got.append(await read_frame(stream))
            except StreamClosed:
                stream.close()

        server = await serve(lambda stream: asyncio.ensure_future(read(stream)),
                             "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await _open(port)
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
        reader, writer = await _connect(port)
        write_frame(writer, b"not a message")
        answer = m.decode(await read_frame(reader))
        assert isinstance(answer, m.Refused) and "must start with Register" in answer.reason
        writer.close()

        reader, writer = await _connect(port)
        write_frame(writer, m.encode(register(devices=3)))  # the fleet has 2 per host
        answer = m.decode(await read_frame(reader))
        assert isinstance(answer, m.Refused) and "--devices 2" in answer.reason
        writer.close()

        reader, writer = await _connect(port)
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


def test_a_stream_without_the_token_is_dropped_before_anything_is_decoded(caplog):
    async def main():
        service, manager, fleet, port = await _service()
        # No handshake at all: a pickle straight away is never decoded.
        reader, writer = await _open(port)
        write_frame(writer, m.encode(register()))
        with pytest.raises(StreamClosed):
            await read_frame(reader)
        writer.close()
        # The handshake with another token: the worker learns the controller does not know
        # its token, and the controller drops the stream.
        reader, writer = await _open(port)
        with pytest.raises(auth.Unauthenticated, match="does not know this worker's"):
            await auth.prove_worker(reader, writer, "another secret")
        writer.close()
        for _ in range(100):
            if any("refused a worker stream" in r.message for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        assert fleet.workers == {}
        assert any("refused a worker stream" in r.message for r in caplog.records)
        await service.stop()
    run(main())


def test_a_fleet_without_a_token_takes_workers_without_one():
    async def main():
        service, manager, fleet, port = await _service(token="")
        reader, writer = await _connect(port, token="")
        write_frame(writer, m.encode(register()))
        assert isinstance(m.decode(await read_frame(reader)), m.Welcome)
        writer.close()
        await service.stop()
    run(main())


def test_peer_data_requests_carry_a_mac_of_their_buffer():
    assert auth.fetch_allowed(TOKEN, 7, auth.fetch_mac(TOKEN, 7))
    assert not auth.fetch_allowed(TOKEN, 8, auth.fetch_mac(TOKEN, 7))
    assert not auth.fetch_allowed(TOKEN, 7, auth.fetch_mac("another secret", 7))


def test_a_data_server_serves_only_what_the_controller_signed_under_its_key():
    """A worker's memory (the fleet token, its own key, MACs it was given) fetches no other
    buffer of a peer: only the controller knows the peer's key (`Welcome.data_key`)."""
    import numpy as np

    from isthmus import errors
    from isthmus.transport.links import PeerClient, PeerDataServer

    async def main():
        served = {5: np.arange(4.0), 6: np.ones(3)}

        async def fetch(buffer_id):
            return served[buffer_id]

        server = PeerDataServer(fetch)
        peer = await server.start("127.0.0.1")
        server.key = "the controller's key for this worker"
        client = PeerClient()
        try:
            got = await client.fetch(peer, 5, auth.fetch_mac(server.key, 5), timeout=10)
            np.testing.assert_array_equal(got, served[5])
            for buffer_id, mac in ((6, auth.fetch_mac(server.key, 5)),  # another buffer's
                                   (6, auth.fetch_mac(TOKEN, 6)),  # the fleet token's
                                   (6, b"")):
                with pytest.raises(errors.WorkerLost, match="PERMISSION_DENIED"):
                    await client.fetch(peer, buffer_id, mac, timeout=10)
        finally:
            await client.close()
            await server.stop()
    run(main())
