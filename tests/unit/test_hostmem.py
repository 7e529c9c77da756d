"""Host memory helpers: a buffer received into a file of the shared directory is found
again by its bytes (so a put to a worker on this machine links the file instead of writing
one), and the file goes with the buffer."""

import gc
import os

import numpy as np

from isthmus.hostmem import backing_file, shared_empty


def test_a_file_backed_buffer_is_found_by_its_bytes_and_goes_with_them(tmp_path):
    buffer = shared_empty(str(tmp_path), 3 << 20)
    assert buffer is not None and buffer.flags.writeable
    buffer[:] = 7
    path = backing_file(buffer)
    assert path is not None and os.path.dirname(path) == str(tmp_path)
    with open(path, "rb") as f:  # another process would see these very bytes
        assert f.read(4) == b"\x07" * 4
    as_floats = buffer.view(np.float32).reshape(-1, 1024)
    assert backing_file(as_floats) == path  # the whole buffer, as the put sees it
    assert backing_file(buffer[1:]) is None and backing_file(as_floats[::2]) is None
    assert backing_file(np.ones(4)) is None
    del buffer, as_floats
    gc.collect()
    assert not os.path.exists(path)


def test_no_room_or_no_directory_is_none(tmp_path):
    assert shared_empty(str(tmp_path / "missing"), 1 << 20) is None
    assert os.listdir(tmp_path) == []
