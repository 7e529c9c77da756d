"""Checkpoint shards written and read by the hosts themselves (pathwaysutils' persistence).

An array saved under `LOCATION/NAME` is a directory (on a local path or any fsspec URL):

    meta.json                      {"format": 1, "dtype": "float32", "shape": [64, 32],
                                    "boxes": [[[0, 32], [0, 32]], [[32, 64], [0, 32]]]}
    shard-0-32_0-32.npy            one .npy per distinct box of the array's sharding
    shard-32-64_0-32.npy

Each distinct box is written once, by the host of the first device that holds it, under a
temporary name and renamed into place; `meta.json` is written last, by the host of the
array's first device, once the controller has heard that every shard is written, so a
directory with a `meta.json` is complete. A read needs no particular sharding or fleet
shape: each host finds, for every box it must hold, the saved boxes that overlap it and
copies their overlaps (memory-mapped when the files are local). Bytes never pass through
the controller or the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import io
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

import numpy as np

from isthmus import errors
from isthmus.compat.jaxlib_types import JaxArray, JaxlibDevice
from isthmus.ids import BufferId

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from isthmus.worker.slots import HostArray

FORMAT = 1
# Testing aid: a host that writes a local shard whose path matches this glob stops with the
# file half written (its temporary in place) until it is killed, so that tests can take a
# worker down in the middle of a save without racing its timing.
TEST_STALL_ENV = "ISTHMUS_TEST_STALL_WRITE"
logger = logging.getLogger(__name__)
Box = tuple[tuple[int, int], ...]
# numpy parses .npy headers with `ast.literal_eval`, which CPython 3.11 cannot run in several
# threads at once ("AST constructor recursion depth mismatch"): one parse at a time.
_HEADERS = threading.Lock()
_T = TypeVar("_T")


def shard_file(box: Box) -> str:
    return "shard-" + "_".join(f"{a}-{b}" for a, b in box) + ".npy"


def _filesystem(location: str) -> tuple[AbstractFileSystem, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(location)
    except (ImportError, ValueError) as e:
        raise errors.InvalidRequest(f"cannot use the checkpoint location {location!r}: {e} "
                                    "(install the fsspec backend for that URL)") from None
    except Exception as e:  # noqa: BLE001 - a backend that connects at once (ftp://) fails
        #   in its own ways (EOFError, socket errors): the location is what is wrong
        raise errors.InvalidRequest(
            f"cannot use the checkpoint location {location!r} ({type(e).__name__}: {e}); "
            "pick a location every host can reach.") from None


def _is_local(fs: AbstractFileSystem) -> bool:
    return (fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]) in ("file",
                                                                               "local")


def _write_atomically(fs: AbstractFileSystem, path: str, data: bytes | np.ndarray) -> None:
    """Writes bytes, or an array as .npy, so that readers see the whole file or none."""
    if not _is_local(fs):
        if isinstance(data, np.ndarray):
            out = io.BytesIO()
            np.save(out, data, allow_pickle=False)
            data = out.getvalue()
        fs.pipe_file(path, data)  # one object write: whole or absent
        return
    temporary = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(temporary, "wb") as f:
            if isinstance(data, np.ndarray):
                np.save(f, data, allow_pickle=False)  # straight from the array
            else:
                f.write(data)
            _stall_if_asked(path)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _stall_if_asked(path: str) -> None:
    pattern = os.environ.get(TEST_STALL_ENV)
    if pattern and fnmatch.fnmatch(path, pattern):
        logger.warning("stopping in the middle of writing %s until killed (%s=%s)", path,
                       TEST_STALL_ENV, pattern)
        while True:
            time.sleep(1)


def write_boxes(location: str, values: Sequence[tuple[np.ndarray, Box]]) -> int:
    """Writes shards (blocking); returns the bytes written."""
    fs, root = _filesystem(location)
    fs.makedirs(root, exist_ok=True)
    total = 0
    for value, box in values:
        array = np.asarray(value, order="C")  # keeps 0-d arrays 0-d
        _write_atomically(fs, f"{root}/{shard_file(box)}", array)
        total += array.nbytes
    return total


def write_meta(location: str, dtype: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    fs, root = _filesystem(location)
    fs.makedirs(root, exist_ok=True)
    meta = {"format": FORMAT, "dtype": dtype, "shape": list(shape),
            "boxes": [[list(r) for r in box] for box in dict.fromkeys(boxes)]}
    _write_atomically(fs, f"{root}/meta.json", json.dumps(meta).encode())


def read_box(location: str, dtype: np.dtype, shape: Sequence[int], box: Box) -> np.ndarray:
    """The part `box` of a saved array, from the saved shards that overlap it (blocking)."""
    fs, root = _filesystem(location)
    try:
        with fs.open(f"{root}/meta.json", "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        raise errors.InvalidRequest(
            f"no complete checkpoint array at {location} (meta.json is missing: it was never "
            "saved there, or its save did not finish).") from None
    if tuple(meta["shape"]) != tuple(shape) or meta["dtype"] != np.dtype(dtype).name:
        raise errors.InvalidRequest(
            f"the array at {location} is {meta['dtype']}{meta['shape']}, not "
            f"{np.dtype(dtype).name}{list(shape)}; restore it with its own dtype and shape.")
    out = np.empty(tuple(b - a for a, b in box), dtype)
    covered = 0
    local = _is_local(fs)
    for saved in meta["boxes"]:
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, saved)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        path = f"{root}/{shard_file(tuple(tuple(r) for r in saved))}"
        if not fs.exists(path):
            raise errors.InvalidRequest(f"the checkpoint at {location} is damaged: its shard "
                                        f"{path.rsplit('/', 1)[-1]} is missing.")
        if local:
            with _HEADERS:
                data = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            with fs.open(path, "rb") as f:
                raw = io.BytesIO(f.read())
            with _HEADERS:
                data = np.load(raw, allow_pickle=False)
        if data.dtype != dtype:  # .npy keeps ml_dtypes (bfloat16, float8) as raw bytes
            data = data.view(dtype)
        source = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, saved))
        target = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, box))
        out[target] = data[source]
        covered += int(np.prod([hi - lo for lo, hi in overlap]))
    if covered < out.size:
        raise errors.InvalidRequest(f"the shards at {location} do not cover the box {box}; "
                                    "the checkpoint is damaged.")
    return out


class Shards(Protocol):
    """What checkpoint I/O needs of a host's buffers (`buffers.BufferStore` gives it)."""

    def value(self, buffer_id: BufferId) -> JaxArray | HostArray:
        """The buffer's array; raises its error (or that it is missing or deleted)."""

    def store(self, buffer_id: BufferId, value: JaxArray) -> None:
        """Makes `value` the buffer `buffer_id`."""

    def fail(self, buffer_id: BufferId, error: errors.IsthmusError) -> None:
        """Makes the buffer an error."""


class Checkpoints:
    """Writing and reading checkpoint shards of a host's buffers, in the host's threads (a
    part of `DeviceHost`: it sees the buffers through `Shards` only)."""

    def __init__(self, shards: Shards, devices: Mapping[int, JaxlibDevice],
                 pool: concurrent.futures.Executor,
                 storing: Callable[[Awaitable[None]], Awaitable[None]] | None = None) -> None:
        self._shards = shards
        self._devices = devices  # by global id
        self._pool = pool
        # Registers work that will store buffers from threads (the host's `settle_writes`
        # then waits for it before a new collective group adopts the buffers).
        self._storing = storing or (lambda work: work)

    def write_shards(self, location: str, items: Sequence[tuple[BufferId, Box]]
                     ) -> Awaitable[int]:
        """Writes these buffers' data as the shards of `location`; resolves to bytes."""
        try:
            values = [(self._shards.value(b), box) for b, box in items]
        except errors.IsthmusError as e:
            return _failed(e)

        async def run() -> int:
            # One task per shard: the host's threads write them side by side.
            sizes = await asyncio.gather(*(
                _in_thread(self._pool, lambda v=v, box=box: write_boxes(
                    location, [(np.asarray(v), box)]), "writing checkpoint shards")
                for v, box in values))
            return sum(sizes)

        return run()

    def write_meta(self, location: str, dtype: str, shape: Sequence[int],
                   boxes: Sequence[Box]) -> Awaitable[None]:
        return _in_thread(self._pool, lambda: write_meta(location, dtype, shape, boxes),
                          "writing the checkpoint's index")

    def read_shards(self, location: str, dtype: str, shape: Sequence[int],
                    items: Sequence[tuple[BufferId, int, Box]]) -> Awaitable[None]:
        """Makes each buffer the part `box` of the saved array, on its device."""
        import jax

        def work(buffer_id: BufferId, device_id: int, box: Box) -> None:
            value = read_box(location, np.dtype(dtype), shape, box)
            self._shards.store(buffer_id, jax.device_put(value, self._devices[device_id]))

        async def run() -> None:
            try:
                await asyncio.gather(*(
                    _in_thread(self._pool, lambda item=item: work(*item),
                               "reading checkpoint shards") for item in items))
            except errors.IsthmusError as e:
                for buffer_id, _, _ in items:
                    self._shards.fail(buffer_id, e)
                raise

        return self._storing(run())


async def _failed(error: errors.IsthmusError) -> NoReturn:
    raise error


async def _in_thread(pool: concurrent.futures.Executor, work: Callable[..., _T], doing: str
                     ) -> _T:
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, work)
    except errors.IsthmusError:
        raise
    except OSError as e:
        raise errors.InvalidRequest(f"{doing} failed: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise errors.from_runtime_error(e, errors.ExecutionError, f"{doing} failed") from None
