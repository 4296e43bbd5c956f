"""Waiting for work in progress to end, as every drain does (the data plane's requests, an engine's sequences, a
deployment's streams): one poll period, one deadline on the monotonic clock. No torch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.02  # how often a drain looks again: a stop's grace is seconds, so 20 ms is lost at most once


async def until_idle(busy: Callable[[], bool], grace_s: float) -> bool:
    """Wait while `busy()` for up to `grace_s` seconds; whether it is idle now."""
    deadline = time.monotonic() + max(0.0, grace_s)
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return not busy()
