"""Host memory for bulk data: aligned buffers, byte views, files of the shared directory."""

from __future__ import annotations

import itertools
import mmap
import os
import weakref
from typing import Any

import numpy as np

# Larger buffers are mapped with their pages made present up front: one kernel call instead of
# a page fault per 4 KiB while the data is written (a third of the time of a 256 MiB upload).
POPULATE_BYTES = 4 << 20


def aligned_empty(size: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised byte array of `size` bytes whose start is `alignment`-aligned.

    jaxlib's CPU client adopts aligned host memory without copying it, so data received into
    such a buffer reaches device memory with no further copy.
    """
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size >= POPULATE_BYTES and populate:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        return np.frombuffer(region, np.uint8)  # page-aligned; the array keeps the map alive
    raw = np.empty(size + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + size]


_FILES: dict[int, tuple[str, int]] = {}  # address of a file-backed buffer -> (path, size)
_NAMES = itertools.count()


def shared_empty(directory: str, size: int) -> np.ndarray | None:
    """An uninitialised byte array of `size` bytes whose memory is a new file of `directory`
    (shared, its pages made present), so that other processes can map the very same pages
    (`backing_file`); the file goes when the array is collected. None when the directory
    has no room for it (its space is reserved up front: a full tmpfs never faults later)."""
    path = os.path.join(directory, f"upload-{os.getpid()}-{next(_NAMES)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        remove_quietly(path)
        return None
    finally:
        os.close(fd)
    array = np.frombuffer(region, np.uint8)
    address = array.ctypes.data
    _FILES[address] = (path, size)
    weakref.finalize(region, _forget, address, path)
    return array


def adopt_file(fd: int, path: str, size: int, populate: bool = False,
               keep: bool = True) -> np.ndarray:
    """The `size` bytes of the open file `fd` at `path`, mapped copy-on-write with no copy.
    `keep`: the file is renamed to a name of this process in its directory and known as the
    array's backing file (`backing_file`: a worker on this machine maps the very same pages),
    and it goes when the array is collected. Else, or where the rename fails, it is removed
    at once (the mapping keeps its bytes) and the array has no backing file.

    `populate`: every page is mapped at once (MAP_POPULATE) rather than one fault per page as
    it is read; on the TPU machine's sandbox a 256 MiB `device_put` from the mapping ran at
    0.57 GB/s page by page and 3.48 populated (6.21 from memory)."""
    flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    region = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    array = np.frombuffer(region, np.uint8)
    if not keep:
        remove_quietly(path)
        return array
    kept = os.path.join(os.path.dirname(path), f"upload-{os.getpid()}-{next(_NAMES)}")
    try:
        os.rename(path, kept)
    except OSError:
        remove_quietly(path)
        return array
    address = array.ctypes.data
    _FILES[address] = (kept, size)
    weakref.finalize(region, _forget, address, kept)
    return array


def backing_file(value: np.ndarray) -> str | None:
    """The file of `shared_empty` whose bytes are exactly `value`'s, if there is one."""
    if not value.flags.c_contiguous:
        return None
    known = _FILES.get(value.ctypes.data)
    return known[0] if known is not None and known[1] == value.nbytes else None


def _forget(address: int, path: str) -> None:
    _FILES.pop(address, None)
    remove_quietly(path)


def remove_quietly(path: str) -> None:
    """Removes a file if it is there (a file of the shared directory that may be gone)."""
    try:
        os.unlink(path)
    except OSError:
        pass


class Assembly:
    """The bytes of one buffer arriving in pieces: a piece that is the whole buffer is kept
    as it came (a view of its frame, no copy); several are copied into one aligned buffer."""

    __slots__ = ("nbytes", "_bytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._bytes: np.ndarray | None = None

    def add(self, offset: int, data: Any) -> None:
        if self._bytes is None and offset == 0 and len(data) == self.nbytes:
            self._bytes = np.frombuffer(data, np.uint8)
            return
        if self._bytes is None or not self._bytes.flags.writeable:
            whole = aligned_empty(self.nbytes)
            if self._bytes is not None:  # a whole piece, then more: the later bytes win
                whole[:] = self._bytes
            self._bytes = whole
        self._bytes[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def value(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """The buffer as an array (zeros where no piece came)."""
        raw = self._bytes if self._bytes is not None else np.zeros(self.nbytes, np.uint8)
        return raw.view(dtype).reshape(shape)


def byte_view(value: np.ndarray) -> np.ndarray:
    """`value`'s bytes in C order as a flat uint8 array (a copy only when it is strided)."""
    return np.ascontiguousarray(value).reshape(-1).view(np.uint8)


def write_file(path: str, value: np.ndarray) -> None:
    """`value`'s bytes (C order) into a new file; an existing one is an error."""
    with open(path, "xb") as f:
        f.write(memoryview(byte_view(value)))


def map_file(path: str, read_only: bool = False, populate: bool = False) -> np.ndarray:
    """A file's bytes as a flat uint8 array, mapped copy-on-write (no copy is made; the
    mapping keeps the bytes when the file is removed). `read_only`: a read-only array whose
    pages are mapped up front, for bytes that are only sent on (a third less time than
    faulting them in one by one). `populate`: a writable one whose pages are mapped up front
    (an accelerator's `device_put` reads all of it; see `adopt_file`)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return np.empty(0, np.uint8)
        up_front = getattr(mmap, "MAP_POPULATE", 0)
        if read_only and up_front:
            return np.frombuffer(mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | up_front,
                                           prot=mmap.PROT_READ), np.uint8)
        if populate and up_front:
            return np.frombuffer(mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE | up_front,
                                           prot=mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), np.uint8)


# ---- the client's allocator ------------------------------------------------------------------

# glibc malloc settings for the stock client of `isthmus run`, whose fetch copies each array
# into a fresh block of its size and then into the array jax returns:
# - mmap_max=0, trim_threshold: large blocks come from the heap, and what the client frees
#   stays there for the next transfer (pages already touched: clearing fresh pages is the
#   slow part of a fetch in a VM);
# - hugetlb=1: the heap in transparent huge pages where the kernel offers them;
# - top_pad: the heap grows 64 MiB at a time. Grown 128 KiB at a time (glibc's default), a
#   fetch into memory the process never had stalled for 6-8 s per 256 MiB on a gVisor
#   sandbox (the TPU machine of bench/RESULTS.md), against 0.3 s with large steps.
CLIENT_TUNABLES = ("glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:"
                   "glibc.malloc.hugetlb=1:glibc.malloc.top_pad=67108864")
CLIENT_MALLOC_VARIABLE = "ISTHMUS_CLIENT_MALLOC"  # "default": glibc's own settings


def client_allocator_environment(env: dict[str, str]) -> dict[str, str]:
    """What `isthmus run` adds to its command's environment `env` for the allocator:
    `CLIENT_TUNABLES`, unless the user set GLIBC_TUNABLES themselves or asked for glibc's
    defaults (ISTHMUS_CLIENT_MALLOC=default). The price: memory the client frees stays in
    its process (its peak of transfers in flight), documented in docs/running.md."""
    if "GLIBC_TUNABLES" in env or env.get(CLIENT_MALLOC_VARIABLE, "") == "default":
        return {}
    return {"GLIBC_TUNABLES": CLIENT_TUNABLES}
