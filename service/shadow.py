"""Shadow traffic: a route's mirrored requests, run on a shadow model on spare capacity only, and compared with the
answers the clients got. A client never waits for its shadow: the mirror is taken after its answer is computed, waits
in a short list (the oldest dropped when full), runs only while the ingress has no request in progress, and is
stopped mid-run (ORT's terminate flag) when one arrives. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)
SHADOW_QUEUE = 32  # mirrored requests waiting for spare capacity; past it the oldest is dropped (counted)
BUSY_POLL_S = 0.05  # while requests are in progress, how often a waiting mirror looks for spare capacity again

# Outcomes of a mirrored request (the `outcome` label): compared with the answer; dropped from the full list or on a
# shadow model that was busy; preempted by a client's request mid-run; failed (the shadow refused it or broke).
COMPARED, DROPPED, PREEMPTED, FAILED = "compared", "dropped", "preempted", "failed"


@dataclass(frozen=True)
class Mirror:
    """One mirrored request: what the client sent and what it was answered."""

    route: str
    primary: str  # the model that answered
    shadow: str
    ids: np.ndarray  # (n, T) int64
    mask: np.ndarray  # (n, T) int64
    answered: np.ndarray  # (n, C) float32 logits the client got


@dataclass(frozen=True)
class Agreement:
    """How a shadow's logits compare with the answered ones, for one request."""

    rows: int
    agreeing: int  # rows whose predicted label (argmax) is the same
    max_abs_diff: float  # the largest absolute logit difference over every row and class


def compare(answered: np.ndarray, shadow: np.ndarray) -> Agreement:
    """(n, C) answered logits and (n, C) shadow logits -> their agreement."""
    if answered.shape != shadow.shape:
        raise ValueError(f"shadow logits {shadow.shape} do not match the answer's {answered.shape}")
    agreeing = int((answered.argmax(axis=1) == shadow.argmax(axis=1)).sum())
    return Agreement(answered.shape[0], agreeing, float(np.abs(answered - shadow).max()))


RunShadow = Callable[[Mirror], Awaitable[np.ndarray | None]]  # -> (n, C) logits; None: preempted or busy
Record = Callable[[Mirror, str, Agreement | None], None]  # a mirror's outcome (and agreement when compared)


class ShadowTraffic:
    """The ingress's mirrored requests: a bounded list and one worker that runs them one at a time while `busy()`
    says nothing else is in progress; `preempt` stops the run in progress (the ingress calls it per request)."""

    def __init__(
        self, run: RunShadow, preempt: Callable[[str], None], busy: Callable[[], bool], record: Record
    ) -> None:
        self._run, self._preempt, self._busy, self._record = run, preempt, busy, record
        self._waiting: deque[Mirror] = deque()
        self._running: Mirror | None = None
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None

    def offer(self, mirror: Mirror) -> None:
        """Queue a mirrored request; the oldest waiting is dropped when the list is full."""
        if len(self._waiting) >= SHADOW_QUEUE:
            self._record(self._waiting.popleft(), DROPPED, None)
        self._waiting.append(mirror)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work())
        self._wake.set()

    def idle(self) -> None:
        """The ingress has nothing in progress: a mirrored request may run."""
        if self._waiting:
            self._wake.set()

    def preempt(self) -> None:
        """A client's request arrived: stop the shadow run in progress (it is counted as preempted)."""
        if self._running is not None:
            self._preempt(self._running.shadow)

    async def _work(self) -> None:
        while True:
            self._wake.clear()
            if not self._waiting:
                await self._wake.wait()
                continue
            if self._busy():  # looked at again when the ingress says it is idle, or soon: it may not say so
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), BUSY_POLL_S)
                continue
            mirror = self._waiting.popleft()
            self._running = mirror
            try:
                logits = await self._run(mirror)
            except Exception:  # the shadow refused the request or broke: counted, the clients see nothing
                logger.debug("shadow run on %s failed", mirror.shadow, exc_info=True)
                self._record(mirror, FAILED, None)
                continue
            finally:
                self._running = None
            if logits is None:
                self._record(mirror, PREEMPTED, None)
            else:
                self._record(mirror, COMPARED, compare(mirror.answered, logits))
