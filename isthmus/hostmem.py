"""Host memory for bulk data."""

from __future__ import annotations

import numpy as np


def aligned_empty(size: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised byte array of `size` bytes whose start is `alignment`-aligned.

    jaxlib's CPU client adopts aligned host memory without copying it, so data received into
    such a buffer reaches device memory with no further copy.
    """
    raw = np.empty(size + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + size]
