import gc
import os
import types

import ml_dtypes
import numpy as np
import pytest

from isthmus import dtypes, errors
from isthmus.frontend.transfers import check_upload_strides, decode_host_array, encode_host_array
from isthmus.hostmem import backing_file
from isthmus.protocol.schema import schema

SESSION = types.SimpleNamespace(schema=schema())


def test_strided_view_decodes_without_copy():
    full = np.arange(16, dtype=np.float32).reshape(4, 4)
    region = full.tobytes()[: 24]  # 2x2 view at strides (16, 4): 24 bytes
    view = decode_host_array(SESSION, memoryview(bytearray(region)), dtypes.BY_KIND["KIND_F32"],
                             (2, 2), (16, 4))
    np.testing.assert_array_equal(view, full[:2, :2])


def test_size_mismatch_is_refused():
    with pytest.raises(errors.InvalidRequest, match="needs 16"):
        decode_host_array(SESSION, memoryview(b"\0" * 12), dtypes.BY_KIND["KIND_F32"], (2, 2),
                          None)



@pytest.mark.parametrize("shape,strides,says", [
    ((2, 2), (-8, 4), "negative"),
    ((2, 2), (8,), "rank"),
    ((1 << 22,), (0,), "overlap"),  # 4 bytes standing for 16 MiB
    ((4, 4), (4, 8), "overlap"),  # rows interleave with columns
])
def test_upload_strides_keep_elements_apart(shape, strides, says):
    with pytest.raises(errors.InvalidRequest, match=says):
        check_upload_strides(dtypes.BY_KIND["KIND_F32"], shape, strides)


@pytest.mark.parametrize("shape,strides", [
    ((3, 4), (16, 4)),  # C order
    ((3, 4), (4, 12)),  # Fortran order
    ((3, 1, 4), (16, 0, 4)),  # a dimension of 1 may have any stride
    ((2, 3), (32, 8)),  # gaps are fine
    ((0, 3), (0, 0)),  # no element: numpy gives an empty array such strides
])
def test_upload_strides_that_are_fine(shape, strides):
    check_upload_strides(dtypes.BY_KIND["KIND_F32"], shape, strides)


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, ml_dtypes.bfloat16, np.complex128])
def test_encode_round_trips_with_strides(dtype):
    x = (np.arange(12).reshape(3, 4) % 5).astype(dtype)
    kind = dtypes.from_numpy(np.dtype(dtype))
    dense = encode_host_array(SESSION, x, kind, None)
    assert bytes(dense) == x.tobytes()
    fortran = encode_host_array(SESSION, x, kind, (x.itemsize, 3 * x.itemsize))
    back = decode_host_array(SESSION, fortran, kind, (3, 4), (x.itemsize, 3 * x.itemsize))
    np.testing.assert_array_equal(back, x)


def test_strings():
    x = np.array([[b"a", b"bc"], [b"", b"\xff"]], dtype=object)
    data = encode_host_array(SESSION, x, dtypes.STRING, None)
    back = decode_host_array(SESSION, data, dtypes.STRING, (2, 2), None)
    assert back.tolist() == x.tolist()
    with pytest.raises(errors.InvalidRequest, match="needs 3 strings"):
        decode_host_array(SESSION, data, dtypes.STRING, (3,), None)


@pytest.mark.parametrize("populate", [False, True], ids=["lazy", "populated"])
def test_a_shared_file_maps_whole_and_is_removed(tmp_path, populate):
    from isthmus.frontend.host_buffers import map_shared_file

    data = np.arange(1 << 18, dtype=np.uint32).tobytes()  # 1 MiB
    (tmp_path / "lt_7").write_bytes(data)
    (tmp_path / "lt_6").write_bytes(data)
    alone = map_shared_file(str(tmp_path), 6, len(data), populate=populate)
    assert os.listdir(tmp_path) == ["lt_7"]  # no worker to link it: removed at once
    assert bytes(alone) == data and backing_file(np.frombuffer(alone, np.uint8)) is None
    view = map_shared_file(str(tmp_path), 7, len(data), populate=populate, keep=True)
    assert not (tmp_path / "lt_7").exists()
    assert bytes(view) == data
    # The file stays under a name of the server's as the bytes' backing file: a put to a
    # worker on this machine links it rather than writing a copy (`transport/remote.py`).
    array = np.frombuffer(view, np.uint32)
    kept = backing_file(array)
    assert kept is not None and os.path.dirname(kept) == str(tmp_path)
    assert (tmp_path / os.path.basename(kept)).read_bytes() == data
    view[:4] = b"\1\2\3\4"  # a private mapping: writes stay in this process
    assert (tmp_path / os.path.basename(kept)).read_bytes() == data
    del view, array
    gc.collect()
    assert os.listdir(tmp_path) == []  # the file went with the bytes
    with pytest.raises(errors.InvalidRequest, match="not the 5 announced"):
        (tmp_path / "lt_8").write_bytes(data)
        map_shared_file(str(tmp_path), 8, 5, populate=populate, keep=True)
    assert os.listdir(tmp_path) == []
