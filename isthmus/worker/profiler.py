"""A host's profile commands (`commands.StartProfile`, `StopProfile`) on this process's
profiler (`isthmus/profiling.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from isthmus import errors
from isthmus.profiling import PROCESS, host_name, stop_and_write
from isthmus.transport.records import TraceOptions


class HostProfiles:
    """A host's profile commands (`commands.StartProfile`, `StopProfile`): the host's
    process's profiler (a part of `DeviceHost`, with no state of its own)."""

    def start(self, trace: str, options: TraceOptions) -> Awaitable[bool]:
        """Starts this process's profiler for `trace` (at once: programs the host runs
        after this command are in the trace)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(PROCESS.start(trace, options))
        except errors.IsthmusError as e:
            future.set_exception(e)
        return future

    def stop(self, trace: str, directory: str, label: str) -> Awaitable[str | None]:
        """Stops `trace` and writes this host's file (`host_name(label)`) in `directory`."""
        return asyncio.get_running_loop().run_in_executor(
            None, stop_and_write, trace, directory, host_name(label))
