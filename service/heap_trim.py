"""Giving freed heap memory back to the operating system when a decoder's engine goes idle. A KV cache's arrays are
megabytes each and change size every step; glibc's malloc raises its mmap threshold after freeing such blocks (up to
32 MiB), so later ones come from the heap and stay in the process once freed: the serving process would keep its
busiest moment's size. A fixed threshold returns them but halved the engine's tokens/s (fresh pages every step), so
the heap is trimmed instead (glibc's `malloc_trim`, through ctypes), at most every MIN_INTERVAL_S, when the engine
holds nothing and at least TRIM_ABOVE bytes lie free (a trim's pages come back as faults when the next request needs
them). Elsewhere than glibc it does nothing. No torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_S = 1.0  # a trim walks every arena: an engine that idles between requests trims once a second at most
TRIM_ABOVE = 16 << 20  # free heap bytes below which a trim is not worth the next request's page faults

_lock = threading.Lock()
_last = float("-inf")
_libc: ctypes.CDLL | None = None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with malloc_trim and mallinfo2 (2.33 and later), else None."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if hasattr(_libc, "mallinfo2"):
            _libc.mallinfo2.restype = _Mallinfo2
    return _libc if hasattr(_libc, "malloc_trim") and hasattr(_libc, "mallinfo2") else None


def free_bytes() -> int:
    """Bytes free in the heap's chunks (glibc's mallinfo2 fordblks); 0 elsewhere."""
    libc = _glibc()
    return int(libc.mallinfo2().fordblks) if libc is not None else 0


def trim() -> bool:
    """Return the heap's free pages to the OS, unless looked at within MIN_INTERVAL_S or less than TRIM_ABOVE is
    free; whether it ran."""
    global _last
    now = time.monotonic()
    with _lock:
        if now - _last < MIN_INTERVAL_S:
            return False
        _last = now
    libc = _glibc()
    if libc is None or libc.mallinfo2().fordblks < TRIM_ABOVE:
        return False
    libc.malloc_trim(0)
    return True
