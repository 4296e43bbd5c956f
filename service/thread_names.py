"""Operating-system names for a serving process's threads, so that `top -H`, `ps -L` and /proc/PID/task/*/comm tell
apart the event loop, a model's run threads and the threads ONNX Runtime and CUDA start for it (Python before 3.14
names none of its threads for the OS; a new thread takes its creator's name). Linux only; elsewhere a no-op."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from collections.abc import Iterator

PR_SET_NAME, PR_GET_NAME = 15, 16  # linux/prctl.h
NAME_BYTES = 15  # the kernel keeps 16 bytes, the NUL included

LOOP = "mha-loop"  # the thread of the event loop that serves requests (HTTP, gRPC, the handlers)
RUNS = "run:"  # + a model's name: its run threads (merge a batch, call ORT, wait for it, split the answers)
ENGINE = "ort:"  # + a model's name: the threads ORT (and, for the first GPU session, CUDA) started for its sessions


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def current_name() -> str:
    """The calling thread's OS name ("" where names are not supported)."""
    prctl = _prctl()
    if prctl is None:
        return ""
    buf = ctypes.create_string_buffer(NAME_BYTES + 1)
    return buf.value.decode(errors="replace") if prctl(PR_GET_NAME, buf, 0, 0, 0) == 0 else ""


def name_thread(name: str) -> bool:
    """Name the calling thread `name` (its first 15 bytes) for the OS; False where it cannot, or on the main thread,
    whose name is the process's own (what `ps` and `pkill` match)."""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is threading.main_thread():
        return False
    return prctl(PR_SET_NAME, name.encode()[:NAME_BYTES], 0, 0, 0) == 0


@contextlib.contextmanager
def threads_named(name: str) -> Iterator[None]:
    """Within the block the calling thread is named `name`, so that the threads started meanwhile (ORT's pools,
    CUDA's) are named so too; its own name is put back after."""
    before = current_name()
    renamed = name_thread(name)
    try:
        yield
    finally:
        if renamed:
            name_thread(before)
