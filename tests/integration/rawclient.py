"""A protocol-level IFRT proxy client for tests that the stock client cannot express:
malformed requests, unknown handles, hostile shapes, foreign sessions.

It speaks the schema of the installed jaxlib, like the server; every wait has a timeout.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

import grpc

from isthmus.protocol.schema import schema

SERVICE = "/xla.ifrt.proxy.GrpcIfrtService/"
P = "xla.ifrt.proxy."


class RawSession:
    """One IfrtSession stream; `call(kind, **fields)` sends a request and waits for its reply."""

    def __init__(self, address: str, version: int = 25, serdes: int = 3,
                 timeout: float = 30.0) -> None:
        self.s = schema()
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address.removeprefix("grpc://"))
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._ops = itertools.count(1)
        self.error: grpc.RpcError | None = None
        metadata = self.s[P + "GrpcIfrtSessionMetadata"]()
        metadata.version.protocol_version = version
        metadata.version.ifrt_serdes_version_number = serdes
        stream = self.channel.stream_stream(
            SERVICE + "IfrtSession",
            request_serializer=self.s[P + "IfrtRequest"].SerializeToString,
            response_deserializer=self.s[P + "IfrtResponse"].FromString)
        self._call = stream(iter(self._requests.get, None), metadata=(
            ("ifrt-proxy-grpc-ifrt-session-metadata-bin", metadata.SerializeToString()),))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        init = self.call("init_request")
        self.session_id = init.init_response.session_id
        self.devices = [d.id for d in init.init_response.all_devices]

    def _read(self) -> None:
        try:
            for response in self._call:
                with self._cond:
                    self._responses[response.response_metadata.op_id] = response
                    self._cond.notify_all()
        except grpc.RpcError as e:
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def send(self, kind: str | None, body: Any = None) -> int:
        request = self.s[P + "IfrtRequest"]()
        op_id = next(self._ops)
        request.request_metadata.op_id = op_id
        if kind is not None:
            target = getattr(request, kind)
            target.SetInParent()
            if body is not None:
                target.CopyFrom(body)
        self._requests.put(request)
        return op_id

    def wait(self, op_id: int, timeout: float | None = None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            ok = self._cond.wait_for(
                lambda: op_id in self._responses or self.error is not None, timeout)
            if op_id in self._responses:
                return self._responses.pop(op_id)
            if self.error is not None:
                raise self.error
            assert ok, f"no response to op {op_id} within {timeout} s"
            raise TimeoutError(f"no response to op {op_id} within {timeout} s")

    def call(self, kind: str | None, body: Any = None, timeout: float | None = None) -> Any:
        return self.wait(self.send(kind, body), timeout)

    def msg(self, name: str, **fields: Any) -> Any:
        """A message of the schema, e.g. msg("CheckValueReadyRequest", value_handles=[1])."""
        full = name if "." in name else P + name
        return self.s[full](**fields)

    def store(self, handle: int, data: bytes, announce: int | None = None) -> None:
        """Uploads a host buffer (HostBufferStore); `announce`: a size to claim instead of
        the real one."""
        meta = self.s[P + "GrpcHostBufferStoreMetadata"](
            session_id=self.session_id, handle=handle,
            buffer_size=len(data) if announce is None else announce)
        chunk = self.s[P + "GrpcHostBufferStoreRequest"]
        call = self.channel.stream_unary(
            SERVICE + "HostBufferStore", request_serializer=chunk.SerializeToString,
            response_deserializer=self.s[P + "GrpcHostBufferStoreResponse"].FromString)
        pieces = [chunk(data=data[i:i + (1 << 20)]) for i in range(0, len(data), 1 << 20)]
        call(iter(pieces), timeout=self.timeout, metadata=(
            ("ifrt-proxy-grpc-host-buffer-store-metadata-bin", meta.SerializeToString()),))

    def lookup(self, handle: int) -> bytes:
        call = self.channel.unary_stream(
            SERVICE + "HostBufferLookup",
            request_serializer=self.s[P + "GrpcHostBufferLookupRequest"].SerializeToString,
            response_deserializer=self.s[P + "GrpcHostBufferLookupResponse"].FromString)
        request = self.s[P + "GrpcHostBufferLookupRequest"](
            session_id=self.session_id, handle=handle)
        return b"".join(r.data for r in call(request, timeout=self.timeout))

    def delete_host_buffer(self, handle: int) -> None:
        """Frees a host buffer the server published (HostBufferDelete), as the client does
        after reading it."""
        call = self.channel.unary_unary(
            SERVICE + "HostBufferDelete",
            request_serializer=self.s[P + "GrpcHostBufferDeleteRequest"].SerializeToString,
            response_deserializer=self.s[P + "GrpcHostBufferDeleteResponse"].FromString)
        call(self.s[P + "GrpcHostBufferDeleteRequest"](session_id=self.session_id,
                                                        handle=handle), timeout=self.timeout)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self.channel.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status_of(response: Any) -> tuple[int, str]:
    status = response.response_metadata.status
    return status.code, status.message


def hlo_sharding(s: Any, device_ids: list[int]) -> Any:
    """A one-device-per-entry replicated HloSharding ShardingProto."""
    return replicated_sharding(s, device_ids)


OTHER = 3  # xla.OpSharding.Type.OTHER: a tiled sharding


def tiled_sharding(s: Any, device_ids: list[int], tiles: list[int],
                   memory_kind: str = "") -> Any:
    """An HloSharding ShardingProto splitting the array into `tiles` over `device_ids`, in
    list order (tile-assignment entries are positions in the device list)."""
    count = 1
    for t in tiles:
        count *= t
    op = s["xla.OpSharding"](type=OTHER, tile_assignment_dimensions=tiles,
                             tile_assignment_devices=list(range(count)))
    return _hlo_sharding_proto(s, device_ids, op, memory_kind)


def replicated_sharding(s: Any, device_ids: list[int], memory_kind: str = "") -> Any:
    """`hlo_sharding` with a memory kind ("" leaves the default)."""
    return _hlo_sharding_proto(s, device_ids, s["xla.OpSharding"](), memory_kind)


def _hlo_sharding_proto(s: Any, device_ids: list[int], op: Any, memory_kind: str) -> Any:
    hlo = s["xla.ifrt.HloShardingProto"](memory_kind=memory_kind)
    hlo.xla_op_sharding.CopyFrom(op)
    hlo.xla_op_sharding.SetInParent()
    hlo.devices.device_ids.extend(device_ids)
    sharding = s["xla.ifrt.ShardingProto"]()
    sharding.serialized_sharding.type_name = "xla::ifrt::HloSharding"
    sharding.serialized_sharding.data = hlo.SerializeToString()
    return sharding


def array_spec(s: Any, kind: str, shape: list[int], sharding: Any) -> Any:
    """An ArraySpecProto; `kind` e.g. "KIND_F32"."""
    spec = s["xla.ifrt.ArraySpecProto"]()
    spec.dtype.kind = s["xla.ifrt.DTypeProto"].Kind.Value(kind)
    spec.shape.dims.extend(shape)
    spec.sharding.CopyFrom(sharding)
    return spec


def has_body(response: Any) -> bool:
    """The response sets its oneof (an OK response must, even to an empty message)."""
    return response.WhichOneof("response") is not None


def compile_add_one(raw: RawSession) -> int:
    """Compiles `x + 1` for one f32[4] on device 0; returns the executable handle."""
    import jax
    import numpy as np
    from jax._src.lib import _jax
    from jaxlib.mlir.dialects import stablehlo

    lowered = jax.jit(lambda x: x + 1).lower(np.zeros(4, np.float32))
    program = _jax.mlir.serialize_portable_artifact(
        str(lowered.compiler_ir("stablehlo")), stablehlo.get_current_version())
    body = raw.msg("CompileRequest")
    body.program.type_name = "xla::ifrt::XlaProgram"
    body.program.data = program
    options = raw.s["xla.ifrt.XlaCompileOptionsProto"]()
    assignment = options.compile_options.executable_build_options.device_assignment
    assignment.replica_count = 1
    assignment.computation_count = 1
    assignment.computation_devices.add(replica_device_ids=[0])
    body.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
    body.compile_options.data = options.SerializeToString()
    reply = raw.call("compile_request", body)
    assert not status_of(reply)[0], status_of(reply)
    ready = reply.compile_response.ready_future_handle
    assert not status_of(raw.call("check_future_request",
                                  raw.msg("CheckFutureRequest", future_handle=ready)))[0]
    return reply.compile_response.loaded_executable_handle
