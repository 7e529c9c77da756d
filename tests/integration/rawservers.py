"""Raw-protocol clients and the servers they talk to, for the tests that drive requests the
stock client cannot express (`test_hostile_requests.py`, `test_ordering.py`).

`Servers` starts one embedded and one fleet server per module, again after a test killed one;
`Client` is a `RawSession` with the few requests those tests need.
"""

from __future__ import annotations

import numpy as np

from isthmus.testing import LocalServer, process_alive
from tests.integration.fuzz_programs import lowered
from tests.integration.rawclient import (
    RawSession,
    replicated_sharding,
    status_of,
    tiled_sharding,
)

OK, INVALID, DEADLINE, EXHAUSTED, FAILED_PRECONDITION, INTERNAL = 0, 3, 4, 8, 9, 13
ARGS = ["--host-buffer-timeout", "2"]


class Servers:
    """One embedded and one fleet server for the module, started when first asked for and
    started again when a test killed one (so a crash fails its own test only)."""

    def __init__(self) -> None:
        self.running: dict[str, LocalServer] = {}

    def get(self, kind: str) -> LocalServer:
        server = self.running.get(kind)
        if server is None or not self.alive(server):
            if server is not None:
                server.stop()
            if kind == "embedded":
                server = LocalServer(devices=4, args=ARGS)
            else:
                server = LocalServer(devices=None, fleet=(2, 1, 2), args=ARGS)
            server.start()
            self.running[kind] = server
        return server

    @staticmethod
    def pids(server: LocalServer) -> list[int]:
        if server.fleet is None:
            return [server.process.pid]
        return [server.process.pid, *server.worker_pids(0), *server.worker_pids(1)]

    @staticmethod
    def alive(server: LocalServer) -> bool:
        try:
            return server.alive() and all(process_alive(p) for p in Servers.pids(server))
        except Exception:  # noqa: BLE001 - a server that cannot report its status is down
            return False

    def close(self) -> None:
        for server in self.running.values():
            server.stop()


class Client:
    """A RawSession with the few requests these reproductions need."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.pids = Servers.pids(server)
        self.raw = RawSession(server.address, timeout=20)
        self.s = self.raw.s
        self.devices = self.raw.devices
        self.next = 100

    def handle(self) -> int:
        self.next += 1
        return self.next

    def compile(self, name: str, devices: list[int], **build: object) -> int:
        body = self.raw.msg("CompileRequest")
        body.program.type_name = "xla::ifrt::XlaProgram"
        body.program.data = lowered()[name]
        body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
        body.compile_options.data = self.options(devices, **build).SerializeToString()
        reply = self.raw.call("compile_request", body)
        assert status_of(reply)[0] == OK, status_of(reply)
        return reply.compile_response.loaded_executable_handle

    def options(self, devices: list[int], **build: object) -> object:
        options = self.s["xla.ifrt.XlaCompileOptionsProto"]()
        b = options.compile_options.executable_build_options
        b.device_ordinal = -1
        b.num_replicas, b.num_partitions = 1, len(devices)
        b.use_spmd_partitioning = b.use_shardy_partitioner = True
        assignment = b.device_assignment
        assignment.replica_count, assignment.computation_count = 1, len(devices)
        for d in devices:
            assignment.computation_devices.add(replica_device_ids=[d])
        for field, value in build.items():
            setattr(b, field, value)
        return options

    def make_body(self, value: np.ndarray, sharding: object, host: int, handle: int) -> object:
        body = self.raw.msg("MakeArrayFromHostBufferRequest", host_buffer_handle=host,
                            array_handle=handle)
        body.dtype.kind = self.s["xla.ifrt.DTypeProto"].KIND_F32
        body.shape.dims.extend(value.shape)
        body.sharding.CopyFrom(sharding)
        return body

    def put(self, value: np.ndarray, sharding: object) -> int:
        """An uploaded array (upload first, as the stock client mostly does)."""
        handle, host = self.handle(), self.handle()
        self.raw.store(host, value.astype(np.float32).tobytes())
        reply = self.raw.call("make_array_from_host_buffer_request",
                              self.make_body(value, sharding, host, handle))
        assert status_of(reply)[0] == OK, status_of(reply)
        return handle

    def tiled(self, devices: list[int]) -> object:
        return tiled_sharding(self.s, devices, [len(devices)])

    def replicated(self, devices: list[int], memory: str = "") -> object:
        return replicated_sharding(self.s, devices, memory)

    def execute_body(self, exe: int, args: list[int], out: int) -> object:
        return self.raw.msg("LoadedExecutableExecuteRequest", loaded_executable_handle=exe,
                            args_handles=args, result_array_handle=[out])

    def execute(self, exe: int, args: list[int]) -> tuple[int, tuple[int, str]]:
        out = self.handle()
        reply = self.raw.call("loaded_executable_execute_request",
                              self.execute_body(exe, args, out))
        return out, status_of(reply)

    def ready(self, *handles: int) -> tuple[int, str]:
        return status_of(self.raw.call("check_value_ready_request", self.raw.msg(
            "CheckValueReadyRequest", value_handles=list(handles))))

    def read(self, handle: int) -> tuple[tuple[int, str], np.ndarray | None]:
        host = self.handle()
        reply = self.raw.call("copy_to_host_buffer_request", self.raw.msg(
            "CopyToHostBufferRequest", array_handle=handle, host_buffer_handle=host))
        if status_of(reply)[0] != OK:
            return status_of(reply), None
        return status_of(reply), np.frombuffer(self.raw.lookup(host), np.float32)

    def value(self, handle: int) -> bytes:
        """The array's bytes; its read must succeed."""
        status, got = self.read(handle)
        assert status[0] == OK and got is not None, status
        return got.tobytes()

    def assert_up(self) -> None:
        """The server and its workers live, and the session still works."""
        for pid in self.pids:
            assert process_alive(pid), f"process {pid} died:\n{self.server.log()}"
        x = np.arange(8, dtype=np.float32) * 3
        status, got = self.read(self.put(x, self.replicated([self.devices[-1]])))
        assert status[0] == OK and got is not None and got.tobytes() == x.tobytes(), status

    def close(self) -> None:
        self.raw.close()
