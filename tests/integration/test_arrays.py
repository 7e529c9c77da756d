"""Host round trips and array plumbing through the stock client, compared with local jax."""

from tests.integration.harness import compare


def test_devices_and_attributes(server):
    out = compare("""
        import jax
        devices = jax.devices()
        emit("count", len(devices))
        emit("ids", [d.id for d in devices])
        emit("platform", [d.platform for d in devices])
        emit("kind", [d.device_kind for d in devices])
        emit("process_index", [d.process_index for d in devices])
        emit("default_memory", [d.default_memory().kind for d in devices])
        emit("memories", [[m.kind for m in d.addressable_memories()] for d in devices])
        emit("repr", [repr(d) for d in devices])
        emit("str", [str(d) for d in devices])
        emit("local_count", jax.local_device_count())
        emit("process_count", jax.process_count())
    """, server.address)
    assert out["count"] == 8


def test_slice_and_host_attributes(server):
    from tests.integration.harness import run_snippet

    out = run_snippet("""
        import jax
        emit("slice", [d.slice_index for d in jax.devices()])
        emit("host", [d.host_index for d in jax.devices()])
    """, server.address)
    if server.kind == "fleet":  # 2 slices x 2 hosts x 2 devices
        assert out["slice"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        assert out["host"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    else:
        assert out["slice"].tolist() == [0] * 8
        assert out["host"].tolist() == [0] * 8


def test_a_cpu_device_is_its_own_colocated_cpu_device(server):
    # jax's docstring: "If an input device is already a CPU device, it is returned as-is".
    from tests.integration.harness import run_snippet

    out = run_snippet("""
        import jax
        from jax.experimental.colocated_python import colocated_cpu_devices
        devices = jax.devices()
        emit("ids", [d.id for d in colocated_cpu_devices(devices[4:6])])
        emit("all", [d.id for d in colocated_cpu_devices(devices)])
        emit("colocation", [d.colocation_id for d in devices])
    """, server.address)
    assert out["ids"].tolist() == [4, 5]
    assert out["all"].tolist() == list(range(8))
    assert out["colocation"].tolist() == list(range(8))


def test_round_trip_every_dtype(server):
    compare("""
        import jax, jax.numpy as jnp, ml_dtypes
        jax.config.update("jax_enable_x64", True)
        rng = np.random.default_rng(0)
        kinds = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                 np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                 np.complex128, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2,
                 jnp.float8_e4m3b11fnuz, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz,
                 jnp.int4, jnp.uint4]
        for kind in kinds:
            name = np.dtype(kind).name
            x = (rng.standard_normal((3, 5)) * 4).astype(kind)
            y = jax.device_put(x)
            emit(name, np.asarray(y))
            emit(name + "_dtype", str(y.dtype))
            emit(name + "_jit", np.asarray(jax.jit(lambda a: a)(y)))
    """, server.address)


def test_round_trip_shapes_and_strides(server):
    compare("""
        import jax
        x = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
        emit("scalar", np.asarray(jax.device_put(np.float32(3.5))))
        emit("scalar_int", np.asarray(jax.device_put(np.int32(-7))))
        emit("empty", np.asarray(jax.device_put(np.zeros((0, 3), np.float32))))
        emit("empty2", np.asarray(jax.device_put(np.zeros((2, 0, 5), np.int32))))
        emit("transposed", np.asarray(jax.device_put(x.T)))
        emit("strided", np.asarray(jax.device_put(x[::2, 1::3])))
        emit("fortran", np.asarray(jax.device_put(np.asfortranarray(x))))
        # Negative and zero (broadcast) strides are refused by the 0.10 client itself.
        big = np.random.default_rng(1).standard_normal((257, 1031)).astype(np.float32)
        emit("big", np.asarray(jax.device_put(big)))
        emit("rank5", np.asarray(jax.device_put(np.ones((1, 2, 1, 3, 2), np.int16))))
    """, server.address)


def test_string_arrays(server):
    from tests.integration.harness import run_snippet

    out = run_snippet("""
        import jax
        x = np.array(["a", "bcd", "", "ünï"], dtype=np.dtypes.StringDType())
        y = jax.device_put(x, jax.devices()[3])
        emit("value", np.asarray(y).astype(object))
        z = jax.device_put(y, jax.devices()[5])
        emit("moved", np.asarray(z).astype(object))
        emit("dtype", str(y.dtype))
    """, server.address)
    assert out["value"].tolist() == ["a", "bcd", "", "ünï"]
    assert out["moved"].tolist() == ["a", "bcd", "", "ünï"]


def test_device_put_to_each_device_and_memory_kind(server):
    compare("""
        import jax
        x = np.arange(10, dtype=np.int32)
        for d in jax.devices():
            y = jax.device_put(x, d)
            emit(f"on{d.id}", np.asarray(y + d.id))
            emit(f"dev{d.id}", [z.id for z in y.devices()])
        d0 = jax.devices()[0]
        from jax.sharding import SingleDeviceSharding
        pinned = jax.device_put(x, SingleDeviceSharding(d0, memory_kind="pinned_host"))
        emit("pinned", np.asarray(pinned))
        emit("pinned_kind", pinned.sharding.memory_kind)
        back = jax.device_put(pinned, SingleDeviceSharding(d0, memory_kind="device"))
        emit("back", np.asarray(back))
        moved = jax.device_put(jax.device_put(x, jax.devices()[1]), jax.devices()[5])
        emit("moved", np.asarray(moved))
        emit("moved_dev", [z.id for z in moved.devices()])
    """, server.address)


def test_shared_memory_uploads(server):
    # Clients on the server's machine may hand over large buffers through its shared
    # directory (protocol 17's HostBufferReadFromDisk) instead of streaming them.
    import os

    from tests.integration.harness import run_snippet

    shared = server.status()["shared_dir"]
    assert shared and os.path.isdir(shared)
    os.environ["IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY"] = shared
    os.environ["IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES"] = "65536"
    try:
        out = run_snippet("""
            import jax
            from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
            x = np.random.default_rng(5).standard_normal((1024, 1024)).astype(np.float32)
            y = jax.device_put(x)
            s = jax.device_put(x, NamedSharding(Mesh(np.array(jax.devices()), ("d",)),
                                                P("d")))
            emit("same", bool(np.array_equal(np.asarray(y), x)))
            emit("same_sharded", bool(np.array_equal(np.asarray(s), x)))
            emit("sum", float(jax.jit(lambda a: (a * 2).sum())(s)))
            emit("expected", float((x * 2).sum(dtype=np.float32)))
        """, server.address)
    finally:
        del os.environ["IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY"]
        del os.environ["IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES"]
    assert bool(out["same"]) and bool(out["same_sharded"])
    assert abs(float(out["sum"]) - float(out["expected"])) <= 1e-3 * abs(float(out["expected"]))
    assert os.listdir(shared) == []  # every handed-over file was taken and removed


def test_device_put_between_meshes_of_another_device_order(server):
    """jax moves an array to a mesh whose device order differs by reordering its shards
    (a RemapArrays to a ConcreteEvenSharding: shard i stays on its device) and then
    resharding with a program, donating when asked (JAX's pjit_test
    test_device_put_efficient_reshard_* and test_device_put_donate_pytree)."""
    out = compare("""
        import math
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        devices = np.asarray(jax.devices())
        mesh1 = Mesh(devices.reshape(1, 2, 2, 2), ("replica", "data", "seq", "model"))
        mesh2 = Mesh(devices.reshape(1, 1, 2, 2, 2, 1).swapaxes(2, 3).reshape(1, 1, 4, 2, 1),
                     ("replica", "data", "seq", "model_q", "model_kv"))
        for shape in [(8, 2), (8, 384)]:
            value = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
            for spec1, spec2 in [(P("model"), P("model_q")), (P(None, "seq"), P("seq")),
                                 (P(), P("model_q"))]:
                x = jax.device_put(value, NamedSharding(mesh1, spec1))
                kept = jax.device_put(value, NamedSharding(mesh1, spec1))
                moved, donated = jax.device_put((kept, x), NamedSharding(mesh2, spec2),
                                                donate=(False, True))
                emit(f"{shape}{spec1}{spec2}", np.asarray(moved))
                emit(f"{shape}{spec1}{spec2} donated", np.asarray(donated))
                emit(f"{shape}{spec1}{spec2} shards",
                     [(s.device.id, str(s.index)) for s in donated.addressable_shards])
                emit(f"{shape}{spec1}{spec2} kept", np.asarray(kept))
                total = jax.jit(lambda a, b: a + b)(moved, donated)  # used by a program
                emit(f"{shape}{spec1}{spec2} sum", np.asarray(total))
    """, server.address)
    assert len(out) == 2 * 3 * 5
