"""Giving freed heap memory back to the operating system when a decoder's engine goes idle. A KV cache's arrays are
megabytes each and change size every step; glibc's malloc raises its mmap threshold after freeing such blocks (up to
32 MiB), so later ones come from the heap and stay in the process once freed: the serving process would keep its
busiest moment's size. A fixed threshold returns them but halved the engine's tokens/s (fresh pages every step), so
the heap is trimmed instead (glibc's `malloc_trim`, through ctypes), at most every MIN_INTERVAL_S, when the engine
holds nothing. Elsewhere than glibc it does nothing. No torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_S = 1.0  # a trim walks every arena: an engine that idles between requests trims once a second at most

_lock = threading.Lock()
_last = float("-inf")
_libc: ctypes.CDLL | None = None


def _malloc_trim():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return getattr(_libc, "malloc_trim", None)


def trim() -> bool:
    """Return the heap's free pages to the OS, unless done within MIN_INTERVAL_S; whether it ran."""
    global _last
    now = time.monotonic()
    with _lock:
        if now - _last < MIN_INTERVAL_S:
            return False
        _last = now
    malloc_trim = _malloc_trim()
    if malloc_trim is None:  # not glibc
        return False
    malloc_trim(0)
    return True
