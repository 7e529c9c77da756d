"""The checkpoint format of worker-written shards (worker/persistence.py), on a local
directory and an fsspec URL: boxes saved from one sharding read back under any other, ml
dtypes keep their bytes, and an incomplete or mismatched array is refused by name."""

import os

import ml_dtypes
import numpy as np
import pytest

from isthmus import errors
from isthmus.worker.persistence import read_box, shard_file, write_boxes, write_meta


def save(location, value, boxes):
    pieces = [(value[tuple(slice(a, b) for a, b in box)], box) for box in boxes]
    write_boxes(location, pieces)
    write_meta(location, value.dtype.name, value.shape, boxes)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_boxes_read_back_under_another_sharding(tmp_path, where):
    location = str(tmp_path / "w") if where == "local" else f"memory://ckpt-{os.getpid()}/w"
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    rows = [((0, 4), (0, 6)), ((4, 8), (0, 6))]
    save(location, value, rows)
    for box in [((0, 8), (0, 3)), ((0, 8), (3, 6)), ((2, 7), (1, 5)), ((0, 8), (0, 6))]:
        part = read_box(location, np.dtype(np.float32), (8, 6), box)
        np.testing.assert_array_equal(part, value[tuple(slice(a, b) for a, b in box)])
    if where == "local":
        assert sorted(os.listdir(location)) == sorted(["meta.json", *map(shard_file, rows)])


def test_ml_dtypes_and_scalars_keep_their_bytes(tmp_path):
    value = (np.arange(12) % 5).astype(ml_dtypes.bfloat16).reshape(3, 4)
    save(str(tmp_path / "h"), value, [((0, 3), (0, 4))])
    back = read_box(str(tmp_path / "h"), value.dtype, (3, 4), ((1, 3), (0, 4)))
    assert back.dtype == value.dtype
    np.testing.assert_array_equal(back.view(np.uint16), value[1:3].view(np.uint16))
    scalar = np.array(7, np.int64)
    save(str(tmp_path / "s"), scalar, [()])
    assert read_box(str(tmp_path / "s"), np.dtype(np.int64), (), ()) == 7


def test_incomplete_or_mismatched_arrays_are_refused(tmp_path):
    value = np.ones((4, 4), np.float32)
    write_boxes(str(tmp_path / "a"), [(value, ((0, 4), (0, 4)))])  # no meta.json yet
    with pytest.raises(errors.InvalidRequest, match="meta.json is missing"):
        read_box(str(tmp_path / "a"), value.dtype, (4, 4), ((0, 4), (0, 4)))
    write_meta(str(tmp_path / "a"), "float32", (4, 4), [((0, 4), (0, 4))])
    with pytest.raises(errors.InvalidRequest, match="float32\\[4, 4\\], not int32"):
        read_box(str(tmp_path / "a"), np.dtype(np.int32), (4, 4), ((0, 4), (0, 4)))
    write_meta(str(tmp_path / "a"), "float32", (4, 4), [((0, 4), (0, 4))])
    os.unlink(tmp_path / "a" / shard_file(((0, 4), (0, 4))))
    with pytest.raises(errors.InvalidRequest, match="shard-0-4_0-4.npy is missing"):
        read_box(str(tmp_path / "a"), value.dtype, (4, 4), ((0, 4), (0, 4)))
    write_boxes(str(tmp_path / "b"), [(value[:2], ((0, 2), (0, 4)))])
    write_meta(str(tmp_path / "b"), "float32", (4, 4), [((0, 2), (0, 4))])
    with pytest.raises(errors.InvalidRequest, match="do not cover"):
        read_box(str(tmp_path / "b"), value.dtype, (4, 4), ((0, 4), (0, 4)))


def test_json_nested_past_pythons_recursion_is_refused_cleanly():
    """Deeply nested JSON (a hostile plugin program or a shared service's control call)
    is INVALID_ARGUMENT, not a RecursionError answered as INTERNAL."""
    import grpc

    from isthmus.frontend.plugins import PREFIX, plan_of
    from isthmus.wire.lease_methods import _parse
    from isthmus.wire.methods import Refused

    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(errors.InvalidRequest, match="not JSON"):
        plan_of(PREFIX + deep)
    with pytest.raises(Refused) as refused:
        _parse(b'{"a": ' + deep + b"}")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
