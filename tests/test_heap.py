"""Giving the C heap's free pages back (service/heap.py): a trim returns the free pages between blocks still in
use, which glibc keeps by itself, with at least TRIM_ABOVE free, once IDLE_S pass without a holder going idle
again."""

from __future__ import annotations

import ctypes
import platform
import time
from pathlib import Path

import pytest

from service import heap

BLOCK = 4096  # below glibc's mmap threshold: from the heap
BLOCKS = 25_000  # about 100 MiB


def _rss_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def _freed_between_live_blocks() -> tuple[list[int], ctypes.CDLL]:
    """About 100 MiB of the heap touched, then freed but for one block in 64: the heap's top cannot shrink past
    them, nor any page between, so glibc keeps it all. Returns the blocks kept, to free."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for p in blocks:
        ctypes.memset(p, 1, BLOCK)  # touched: resident
    kept = blocks[::64]
    for p in set(blocks) - set(kept):
        libc.free(p)
    return kept, libc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_trim_returns_the_free_pages_between_live_blocks_that_glibc_keeps(monkeypatch):
    kept, libc = _freed_between_live_blocks()
    freed = _rss_kib()
    monkeypatch.setattr(heap, "TRIM_ABOVE", heap.free_bytes() + 1)
    assert not heap.trim(), "it trimmed with less than TRIM_ABOVE free"
    assert _rss_kib() > freed - (10 << 10)
    monkeypatch.setattr(heap, "TRIM_ABOVE", 16 << 20)
    assert heap.free_bytes() > 90 << 20
    assert heap.trim()
    trimmed = _rss_kib()
    for p in kept:
        libc.free(p)
    assert freed - trimmed > 40 << 10, (freed, trimmed)  # most of the 100 MiB that glibc had kept


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_is_trimmed_once_idle_s_pass_without_a_holder_going_idle_again(monkeypatch):
    monkeypatch.setattr(heap, "IDLE_S", 0.5)
    kept, libc = _freed_between_live_blocks()
    freed = _rss_kib()
    for _ in range(16):  # bursts closer together than IDLE_S: not trimmed between them
        heap.idle()
        time.sleep(0.05)
    assert _rss_kib() > freed - (10 << 10), "trimmed between bursts"
    deadline = time.monotonic() + 5.0
    while _rss_kib() > freed - (40 << 10) and time.monotonic() < deadline:
        time.sleep(0.05)
    quiet = _rss_kib()
    for p in kept:
        libc.free(p)
    assert freed - quiet > 40 << 10, (freed, quiet)  # trimmed once quiet
