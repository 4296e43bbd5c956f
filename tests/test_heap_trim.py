"""Giving freed heap memory back to the OS (service/heap_trim.py): on glibc a trim returns the free pages between
blocks still in use, which glibc keeps by itself; trims come at most once per MIN_INTERVAL_S, and only with at least
TRIM_ABOVE free."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from service import heap_trim

BLOCK = 4096  # below glibc's mmap threshold: from the heap
BLOCKS = 25_000  # about 100 MiB


def _rss_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_trim_returns_the_free_pages_between_live_blocks_that_glibc_keeps(monkeypatch):
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for p in blocks:
        ctypes.memset(p, 1, BLOCK)  # touched: resident
    kept = set(blocks[::64])  # one block in 64 stays: the heap's top cannot shrink past it, nor any page between
    for p in blocks:
        if p not in kept:
            libc.free(p)
    freed = _rss_kib()
    monkeypatch.setattr(heap_trim, "_last", float("-inf"))
    monkeypatch.setattr(heap_trim, "TRIM_ABOVE", heap_trim.free_bytes() + 1)
    assert not heap_trim.trim(), "it trimmed with less than TRIM_ABOVE free"
    assert _rss_kib() > freed - (10 << 10)
    monkeypatch.setattr(heap_trim, "_last", float("-inf"))
    monkeypatch.setattr(heap_trim, "TRIM_ABOVE", 16 << 20)
    assert heap_trim.free_bytes() > 90 << 20
    assert heap_trim.trim()
    trimmed = _rss_kib()
    assert not heap_trim.trim(), "a second trim within MIN_INTERVAL_S ran"
    for p in kept:
        libc.free(p)
    assert freed - trimmed > 40 << 10, (freed, trimmed)  # most of the 100 MiB that glibc had kept
