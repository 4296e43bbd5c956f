"""Giving the C heap's free pages back to the operating system once the process is quiet. A KV cache's arrays are
megabytes each and change size every step; glibc's malloc raises its mmap threshold after freeing such blocks (up to
32 MiB), so later ones come from the heap and stay in the process once freed: the serving process would keep its
busiest moment's size. Fixed thresholds (mallopt) either return them as they are freed, at the cost of fresh pages
every step, or keep more after a burst (measured: docs/benchmarks-history.md), so the heap is trimmed instead:
`idle` (a holder of such blocks, an engine or the data plane, holds none now) has glibc's `malloc_trim` run once
IDLE_S pass with no holder going idle again, if at least TRIM_ABOVE bytes lie free. A burst's pages come back as
faults, so bursts close together are not trimmed between. Through ctypes; elsewhere than glibc nothing is done. No
torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

IDLE_S = 1.0  # quiet this long after the last holder went idle, the heap is trimmed
TRIM_ABOVE = 4 << 20  # free heap bytes below which a trim is not worth a walk of every arena

_lock = threading.Lock()
_idle_at = float("-inf")  # monotonic time of the last `idle`
_timer: threading.Timer | None = None
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


def idle() -> None:
    """A holder of large blocks (an engine, the data plane) holds none now: trim once IDLE_S pass without another
    call. Any thread; cheap (one timer thread at a time)."""
    global _idle_at, _timer
    with _lock:
        _idle_at = time.monotonic()
        if _timer is None:
            _timer = _start(IDLE_S)


def _start(delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, _when_quiet)
    timer.daemon = True
    timer.start()
    return timer


def _when_quiet() -> None:
    global _timer
    with _lock:
        wait = _idle_at + IDLE_S - time.monotonic()
        _timer = _start(wait) if wait > 0 else None
    if wait <= 0:
        trim()


def trim() -> bool:
    """Return the heap's free pages to the OS if at least TRIM_ABOVE lie free; whether it ran."""
    libc = _glibc()
    if libc is None or free_bytes() < TRIM_ABOVE:
        return False
    libc.malloc_trim(0)
    return True
