import dataclasses

import pytest

from isthmus import errors
from isthmus.controller.sharding import (
    Sharding,
    ShardingKind,
    even_from,
    is_fully_replicated,
    shard_boxes,
    shard_shape,
    splits,
)
from isthmus.protocol.schema import schema


def op(**fields):
    return schema()["xla.OpSharding"](**fields).SerializeToString()


def hlo(devices, **fields):
    return Sharding(ShardingKind.HLO, tuple(devices), None, op(**fields))


OTHER = 3


def test_replicated_and_single_device():
    assert shard_boxes(hlo([3, 4]), (4, 2)) == (((0, 4), (0, 2)),) * 2
    assert is_fully_replicated(hlo([3, 4]), (4, 2))
    assert shard_boxes(Sharding.single(5), ()) == ((),)


def test_tiled_rows_in_device_list_order():
    s = hlo([7, 6, 5, 4], type=OTHER, tile_assignment_dimensions=[4, 1],
            tile_assignment_devices=[3, 2, 1, 0])
    boxes = shard_boxes(s, (8, 3))
    # Tile assignment entries are positions in the device list: position 3 holds tile 0.
    assert boxes[3] == ((0, 2), (0, 3))
    assert boxes[0] == ((6, 8), (0, 3))
    assert not is_fully_replicated(s, (8, 3))


def test_iota_with_replication_on_last_tile_dim():
    s = hlo(range(8), type=OTHER, tile_assignment_dimensions=[2, 2, 2],
            iota_reshape_dims=[8], iota_transpose_perm=[0], replicate_on_last_tile_dim=True)
    boxes = shard_boxes(s, (4, 6))
    assert boxes[0] == boxes[1] == ((0, 2), (0, 3))
    assert boxes[6] == boxes[7] == ((2, 4), (3, 6))


def test_uneven_tiles_are_shorter_not_padded():
    s = hlo(range(4), type=OTHER, tile_assignment_dimensions=[4],
            tile_assignment_devices=[0, 1, 2, 3])
    assert [shard_shape(b) for b in shard_boxes(s, (5,))] == [(2,), (2,), (1,), (0,)]


def test_bad_tile_assignment_is_a_request_error():
    s = hlo(range(2), type=OTHER, tile_assignment_dimensions=[4],
            tile_assignment_devices=[0, 1, 2, 3])
    with pytest.raises(errors.InvalidRequest):
        shard_boxes(s, (8,))

def test_garbage_sharding_bytes_are_refused_by_the_front_end():
    from isthmus.frontend.serdes import Serdes

    proto = schema()["xla.ifrt.ShardingProto"]()
    proto.serialized_sharding.type_name = "xla::ifrt::HloSharding"
    proto.serialized_sharding.data = b"\x12\xff\xff\xff\x0f"
    with pytest.raises(errors.InvalidRequest, match="does not parse"):
        Serdes(schema()).sharding(proto)
    proto.serialized_sharding.type_name = "xla::ifrt::Nonsense"
    with pytest.raises(errors.Unimplemented, match="Nonsense"):
        Serdes(schema()).sharding(proto)


def test_matches_jaxlib_for_a_jax_named_sharding():
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    named = NamedSharding(mesh, P("b", "a"))
    proto = named._to_xla_hlo_sharding(2).to_proto().SerializeToString()
    s = Sharding(ShardingKind.HLO, tuple(d.id for d in mesh.devices.flat), None, proto)
    expected = named.devices_indices_map((8, 6))
    for device, box in zip(mesh.devices.flat, shard_boxes(s, (8, 6))):
        want = tuple((sl.start or 0, sl.stop if sl.stop is not None else n)
                     for sl, n in zip(expected[device], (8, 6)))
        assert box == want


def test_a_splitting_concrete_even_sharding_takes_its_boxes_from_the_source():
    target = Sharding(ShardingKind.CONCRETE_EVEN, (5, 4, 7, 6), None, shard_shape=(2, 3))
    assert splits(target, (8, 3))
    assert not splits(dataclasses.replace(target, shard_shape=(8, 3)), (8, 3))
    source = ((2, 4), (0, 2), (6, 8), (4, 6))
    boxes = tuple(((a, b), (0, 3)) for a, b in source)
    resolved = even_from(target, boxes, (8, 3), "x")
    assert shard_boxes(resolved, (8, 3)) == boxes and not splits(resolved, (8, 3))
    assert resolved.with_devices((0, 1, 2, 3), None).boxes == boxes  # a copy keeps them
    with pytest.raises(errors.InvalidRequest, match="does not match the source's"):
        even_from(target, boxes[:3], (8, 3), "x")  # too few shards
    with pytest.raises(errors.InvalidRequest, match="does not match the source's"):
        even_from(target, tuple(((0, 4), (0, 3)) for _ in range(4)), (8, 3), "x")
    with pytest.raises(errors.InvalidRequest, match="do not cover"):
        even_from(target, (boxes[0],) * 3 + (boxes[1],), (8, 3), "x")  # one shard twice
    # Replicated twice over: every box twice is even.
    twice = even_from(target, boxes[:2] * 2, (4, 3), "x")
    assert twice.boxes == boxes[:2] * 2


@pytest.mark.parametrize("fields", [
    dict(type=3, tile_assignment_dimensions=[2], iota_reshape_dims=[2], iota_transpose_perm=[5]),
    dict(type=3, tile_assignment_dimensions=[2], iota_reshape_dims=[1 << 40],
         iota_transpose_perm=[0]),
    dict(type=3, tile_assignment_dimensions=[-1, -2], tile_assignment_devices=[0, 1]),
    dict(type=3, tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1]),
    dict(type=2),
])
def test_a_hostile_tile_assignment_is_refused_before_xla_reads_it(fields):
    """XLA trusts an iota's permutation (one out of range read out of bounds: std::bad_alloc
    at best); these are refused from the proto's fields first."""
    with pytest.raises(errors.InvalidRequest, match="tile assignment|tuple"):
        shard_boxes(hlo([0, 1], **fields), (8,))
