"""Arrays written again step after step instead of allocated afresh, but only once nothing refers to them.

A large array allocated every step costs more than its arithmetic: glibc maps
every allocation above 32 MiB afresh, so each step the kernel zeroes and maps
it in again. (Below that, glibc reuses a freed block of the same size: a ring
would only hold memory.)
An array kept and reused costs nothing more, but only if nobody still reads
the old values: a reply kept to answer a resent request, a zero-copy frame
ZeroMQ has not sent yet (pyzmq holds the array until libzmq releases the
frame), a trace. Python's reference count says so exactly, and these
buffers are reused only when it says nobody else holds them.
"""

from __future__ import annotations

import math
import sys

import numpy as np

RING_BUFFERS = 3                # arrays a ring keeps: this step's, the one still cached or in flight, one spare
REUSE_MIN_BYTES = 32 << 20      # glibc's largest mmap threshold: smaller arrays come back from its free lists

_refcount = sys.getrefcount


def _free_refs() -> int:
    """The reference count of a kept array that nobody else holds, read in the loop ``BufferRing.take`` reads
    it in (the ring's list, the loop's name, the call's argument: 3 on CPython 3.10-3.13; measured, not
    assumed, as interpreters count borrowed references differently)."""
    ring = [np.empty(0)]
    for buffer in ring:
        return _refcount(buffer)
    raise AssertionError("unreachable")


FREE_REFS = _free_refs()


class BufferRing:
    """Up to ``RING_BUFFERS`` arrays that one producer (a loss's gradient) writes its output into.

    ``take(shape, dtype)`` returns a kept array of that shape and dtype that
    nobody else refers to any more, to be overwritten whole; else a new one
    (kept while the ring has room, or in place of a free array of another
    shape). Arrays under ``REUSE_MIN_BYTES`` are always new. The values of a
    taken array are undefined: the caller writes every element.
    """

    def __init__(self, size: int = RING_BUFFERS) -> None:
        if size < 1:
            raise ValueError(f"a buffer ring keeps at least one array, got {size}")
        self.size = size
        self._ring: list[np.ndarray] = []

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype.itemsize * math.prod(shape) < REUSE_MIN_BYTES:
            return np.empty(shape, dtype)
        spare, index = -1, 0
        for buffer in self._ring:           # the loop ``_free_refs`` measures in (no enumerate's tuple)
            if _refcount(buffer) == FREE_REFS:
                if buffer.shape == shape and buffer.dtype == dtype:
                    return buffer
                spare = index
            index += 1
        fresh = np.empty(shape, dtype)
        if len(self._ring) < self.size:
            self._ring.append(fresh)
        elif spare >= 0:
            self._ring[spare] = fresh       # the shape changed: the free array of the old one goes
        return fresh
