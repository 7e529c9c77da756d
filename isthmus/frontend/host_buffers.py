"""Host buffers: bytes the client uploads for a request, or downloads after one.

The client streams a buffer (`HostBufferStore`) under a handle it picked, possibly *after*
sending the request that uses it, and it throttles its uploads (64 at a time), so a buffer
may start long after its request when thousands are queued. A request therefore waits for
its buffer's upload to begin as long as the session's uploads move (one begins, brings
bytes or ends), and fails when none has moved for `start_timeout` seconds; once begun, an
upload may take as long as it needs while its bytes come, and fails when none has come for
`start_timeout` seconds. New requests do not count as moving: a client that keeps asking
for buffers it never sends cannot hold the session's queue (and every status and deletion
future behind it) forever. Nothing waits forever. Results of
`CopyToHostBuffer` are put here for the client's `HostBufferLookup`, and dropped by its
`HostBufferDelete`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from isthmus import errors
from isthmus.hostmem import adopt_file, remove_quietly
from isthmus.ids import HostBufferHandle

if TYPE_CHECKING:
    from isthmus.frontend.tenant_limits import UploadBudget

logger = logging.getLogger(__name__)


_CLAIMED = ("host buffer {handle} is already used by another request (or twice in this one) "
            "of this session; upload each buffer under a handle of its own.")

USED_KEPT = 1 << 16  # handles of used buffers remembered per session (about 6 MiB at most)

Receiver = Callable[[memoryview | None, errors.IsthmusError | None], None]


class _Entry:
    __slots__ = ("future", "started", "size", "receiver", "promised", "charged", "moved",
                 "filled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[memoryview] = loop.create_future()
        self.started = False
        self.moved = 0.0  # when its upload last began or brought bytes (`time.monotonic`)
        self.filled = 0  # bytes of it that have come
        self.promised = False  # a download under way (`promise`): looked up without a deadline
        self.size = 0
        self.receiver: Receiver | None = None  # `when_ready`'s, until the buffer is there
        self.charged = 0  # bytes counted against the tenant's upload budget, until dropped


class HostBufferStore:
    """The host buffers of one session."""

    def __init__(self, start_timeout: float, budget: UploadBudget | None = None) -> None:
        self._start_timeout = start_timeout
        # A shared service's tenant's: what its uploads not yet used may hold, over all its
        # sessions (`frontend/tenant_limits.py`); None: no cap beyond the buffer size's.
        self._budget = budget
        self._entries: dict[int, _Entry] = {}
        self._activity = time.monotonic()  # the last upload that began or ended
        self._closed: errors.IsthmusError | None = None
        self.bytes_held = 0
        self._waiting: dict[int, _Entry] = {}  # taken by a request, not yet here
        # The handles of the last USED_KEPT buffers a request took: naming one again is
        # refused at once (it would otherwise wait for an upload that never comes).
        self._used: dict[int, None] = {}
        self._watchdog: asyncio.TimerHandle | None = None

    def _entry(self, handle: int) -> _Entry:
        entry = self._entries.get(handle)
        if entry is None:
            entry = _Entry(asyncio.get_running_loop())
            self._entries[handle] = entry
        return entry

    # ---- uploads (client -> server) ------------------------------------------------------

    def begin(self, handle: HostBufferHandle, size: int) -> None:
        """An upload started: requests waiting on it no longer time out."""
        if self._closed is not None:
            raise self._closed
        if handle in self._used:
            raise errors.InvalidRequest(_CLAIMED.format(handle=handle))
        entry = self._entry(handle)
        if entry.started or entry.future.done():
            raise errors.InvalidRequest(
                f"host buffer {handle} was uploaded twice in this session; use a new handle "
                "for each buffer.")
        if self._budget is not None:
            self._budget.take(size)  # TooLarge over the tenant's cap: nothing is counted
            entry.charged = size
        entry.started = True
        entry.size = size
        self._activity = entry.moved = time.monotonic()

    def progress(self, handle: HostBufferHandle, filled: int) -> None:
        """`filled` bytes of an upload have come so far: it is moving."""
        entry = self._entries.get(handle)
        if entry is not None:
            self._activity = entry.moved = time.monotonic()
            entry.filled = filled

    def complete(self, handle: HostBufferHandle, data: memoryview) -> None:
        self._activity = time.monotonic()
        if handle in self._used:  # already failed and handed over (its upload stalled)
            return
        entry = self._entry(handle)
        if not entry.future.done():
            entry.future.set_result(data)
            self.bytes_held += len(data)
            if entry.receiver is not None:
                self._deliver(handle, entry)

    def abort(self, handle: HostBufferHandle, error: errors.IsthmusError) -> None:
        entry = self._entry(handle)
        self._uncharge(entry)  # its bytes were dropped
        if not entry.future.done():
            entry.future.set_exception(error)
            entry.future.exception()  # retrieved: no "never retrieved" warning
            if entry.receiver is not None:
                self._deliver(handle, entry)

    def when_ready(self, handle: HostBufferHandle, receiver: Receiver) -> None:
        """Removes an uploaded buffer from the store and calls `receiver(data, None)` with
        it (or `receiver(None, error)`): at once if it is here, else in the turn its upload
        ends (or fails, or times out: see `_check`). What `receiver` raises is logged."""
        entry = None if handle in self._used else self._entry(handle)
        if entry is None or entry.receiver is not None:  # a buffer feeds one request
            try:
                receiver(None, errors.InvalidRequest(_CLAIMED.format(handle=handle)))
            except Exception:
                logger.exception("refusing host buffer %s failed", handle)
            return
        entry.receiver = receiver
        if entry.future.done():
            self._deliver(handle, entry)
        else:
            if not self._waiting:  # the first wait: the quiet is counted from now
                self._activity = max(self._activity, time.monotonic())
            self._waiting[handle] = entry
            self._watch()

    def check_unclaimed(self, handles: Sequence[int]) -> None:
        """Raises InvalidRequest when a handle is given twice, or is already waited for by
        an earlier request: each host buffer feeds exactly one request."""
        seen: set[int] = set()
        for handle in handles:
            entry = self._entries.get(handle)
            if handle in seen or handle in self._used or (
                    entry is not None and entry.receiver is not None):
                raise errors.InvalidRequest(_CLAIMED.format(handle=handle))
            seen.add(handle)

    def _deliver(self, handle: int, entry: _Entry) -> None:
        self._used[handle] = None
        if len(self._used) > USED_KEPT:
            del self._used[next(iter(self._used))]
        receiver, entry.receiver = entry.receiver, None
        self._waiting.pop(handle, None)
        error = entry.future.exception()  # done, never cancelled (nothing awaits it)
        data = None if error is not None else entry.future.result()
        self._drop(handle)
        try:
            receiver(data, error)  # type: ignore[misc, arg-type]
        except Exception:
            logger.exception("placing host buffer %s failed", handle)

    def _moved(self, entry: _Entry) -> float:
        """When what a waited-for buffer waits on last moved: its own upload's bytes once it
        began, else any upload of the session."""
        return entry.moved if entry.started else self._activity

    def _watch(self) -> None:
        """One timer for the store, at the earliest deadline of the buffers waited for
        (`_check` fails those that have not moved for `start_timeout` seconds)."""
        if self._watchdog is None and self._waiting:
            deadline = min(self._moved(e) for e in self._waiting.values()) + self._start_timeout
            self._watchdog = asyncio.get_running_loop().call_at(deadline, self._check)

    def _check(self) -> None:
        self._watchdog = None
        now = time.monotonic()
        for handle, entry in list(self._waiting.items()):
            if entry.future.done():
                self._waiting.pop(handle, None)
                continue
            if now - self._moved(entry) < self._start_timeout:
                continue
            self._waiting.pop(handle, None)
            if entry.started:
                error = errors.HostBufferMissing(
                    f"the upload of host buffer {handle} stopped: {entry.filled} of "
                    f"{entry.size} bytes came, then none for {self._start_timeout:g} s. Retry "
                    "the transfer; on a slow link, raise --host-buffer-timeout.")
            else:
                error = errors.HostBufferMissing(
                    f"host buffer {handle} did not start arriving, and no upload of this "
                    f"session has moved for {self._start_timeout:g} s; the client's upload "
                    "failed or was never sent. Retry the transfer; if uploads are slow to "
                    "start, raise --host-buffer-timeout.")
            entry.future.set_exception(error)
            entry.future.exception()
            if entry.receiver is not None:
                self._deliver(handle, entry)
        self._watch()

    # ---- downloads (server -> client) ----------------------------------------------------

    def publish(self, handle: HostBufferHandle, data: memoryview) -> None:
        """Makes a result available to `HostBufferLookup`."""
        if self._closed is not None:
            return
        self.complete(handle, data)

    def promise(self, handle: HostBufferHandle) -> None:
        """A result is on its way here (a CopyToHostBuffer answered before its data is on
        the host): `lookup` waits for it as long as it takes, not `start_timeout`."""
        if self._closed is None:
            self._entry(handle).promised = True

    def fail_download(self, handle: HostBufferHandle, error: errors.IsthmusError) -> None:
        self.abort(handle, error)

    async def lookup(self, handle: HostBufferHandle) -> memoryview:
        """Waits for a published result (it stays until `delete`)."""
        entry = self._entry(handle)
        if not entry.future.done():
            if entry.promised:  # its computation may run for any time: no deadline
                return await asyncio.shield(entry.future)
            try:
                await asyncio.wait_for(asyncio.shield(entry.future), self._start_timeout * 4)
            except TimeoutError:
                raise errors.HostBufferMissing(
                    f"host buffer {handle} was never filled; look up only handles named in a "
                    "CopyToHostBuffer request of this session.") from None
        return entry.future.result()

    def ready(self, handle: HostBufferHandle) -> memoryview | None:
        """A published result if it is there now (None: `lookup` waits, or reports)."""
        entry = self._entries.get(handle)
        if entry is None or not entry.future.done() or entry.future.cancelled() \
                or entry.future.exception() is not None:
            return None
        return entry.future.result()

    def promised(self, handle: HostBufferHandle) -> asyncio.Future[memoryview] | None:
        """The future of a result on its way (`promise`) that is not here yet, or None."""
        entry = self._entries.get(handle)
        if entry is None or not entry.promised or entry.future.done():
            return None
        return entry.future

    def delete(self, handle: HostBufferHandle) -> None:
        self._drop(handle)

    def _uncharge(self, entry: _Entry) -> None:
        if entry.charged and self._budget is not None:
            self._budget.give(entry.charged)
        entry.charged = 0

    def _drop(self, handle: int) -> None:
        entry = self._entries.pop(handle, None)
        if entry is not None:
            self._uncharge(entry)
        if entry is not None and entry.future.done() and not entry.future.cancelled() \
                and entry.future.exception() is None:
            self.bytes_held -= len(entry.future.result())

    def __len__(self) -> int:
        return len(self._entries)

    def close(self, error: errors.IsthmusError) -> None:
        """Ends the store: waiters fail with `error`, held bytes are released."""
        self._closed = error
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._waiting.clear()
        for handle, entry in list(self._entries.items()):
            self._uncharge(entry)
            if not entry.future.done():
                entry.future.set_exception(error)
                entry.future.exception()
                if entry.receiver is not None:
                    self._deliver(handle, entry)
        self._entries.clear()
        self.bytes_held = 0


def map_shared_file(directory: str, handle: int, size: int, populate: bool = False,
                    keep: bool = False) -> memoryview:
    """The bytes of `<directory>/lt_<handle>`, a buffer the client wrote there (protocol 17's
    shared-directory transfer), mapped without copying. The file leaves the client's name at
    once. `keep` (a fleet of worker processes): it stays, under one of the server's names, as
    the bytes' backing file until they are dropped, so that a worker on this machine maps the
    same pages instead of a copy (`hostmem.adopt_file`, `transport/remote.py`); else it is
    removed at once (the mapping keeps the bytes).

    `populate`: the mapping's pages are all mapped at once (MAP_POPULATE) rather than one
    fault per page as they are read (where a page fault is dear, a TPU sandbox: see
    `adopt_file`); a CPU backend may alias the mapping and never read most of it, so it maps
    lazily."""
    path = os.path.join(directory, f"lt_{int(handle)}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise errors.HostBufferMissing(
            f"the shared-directory file for host buffer {handle} cannot be opened ({e}); "
            "client and server must share the directory named by "
            "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise errors.InvalidRequest(
                f"the shared-directory file for host buffer {handle} has {info.st_size} "
                f"bytes, not the {size} announced.")
        if size == 0:
            remove_quietly(path)
            return memoryview(b"")
        return memoryview(adopt_file(fd, path, size, populate, keep))
    except BaseException:
        remove_quietly(path)
        raise
    finally:
        os.close(fd)
