"""Python's cyclic garbage collector, set for a long-lived server process.

The controller and the workers allocate thousands of short-lived objects per second (h2
streams, messages, futures), and with the default thresholds the collector runs every 700
of them, walking the young objects and, every hundred runs, the 120,000 objects that jax,
protobuf and the schemas left from start-up. `settle()` moves what start-up made out of the
collector's sight (`gc.freeze`) and collects young objects every 50,000 allocations. Cycles
among later objects are still collected; start-up's objects are freed by reference counting
as before. Measured (bench/RESULTS.md, issue 10, sixth round): 17% less controller CPU per
pipelined 8-shard put.
"""

from __future__ import annotations

import gc

YOUNG = 50_000  # allocations between collections of the youngest generation
OLDER = (20, 100)  # collections of one generation between those of the next


def settle() -> None:
    """Call once the process has loaded what it keeps for its life (jax, its backend)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, *OLDER)


def give_back() -> None:
    """Returns the memory freed since to the system where the C library keeps it (glibc's
    `malloc_trim`): after a flood of connections closes, say, their buffers' pages would
    stay with the process. Elsewhere, nothing."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    gc.collect()
    trim(0)
