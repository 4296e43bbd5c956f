"""Where a model runs, as the ingress sees it: `Colocated` (its engine in this process, no Ray call per request) or
`Remote` (its own Serve deployment, reached through a handle). Both answer `status`, `infer` and `attention` alike.
No torch.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np
from ray.serve.handle import DeploymentHandle

from service.attention_api import AttentionResult
from service.batching import BatchResult
from service.coalescer import Coalescer
from service.engine import ModelEngine
from service.errors import ModelQueueFullError
from service.inference import ModelStatus
from service.remote_calls import answer_of

STATUS_TIMEOUT_S = 5.0  # a model deployment without a live replica answers nothing; say so instead of hanging
# A mirrored run is refused at once by a busy replica and takes milliseconds otherwise: one still unanswered after
# this is a call Ray will not answer, and the ingress's one shadow worker must go on to the next mirror.
SPARE_TIMEOUT_S = 30.0


async def replica_status(name: str, handle: DeploymentHandle) -> ModelStatus:
    """Ask the model's replica (live); a replica that does not answer is reported as not ready."""
    try:
        return await asyncio.wait_for(answer_of(name, handle.status.remote()), STATUS_TIMEOUT_S)
    except TimeoutError:
        reason = f"no replica answered within {STATUS_TIMEOUT_S:g} s (starting, or failed at start: `serve status`)"
        return ModelStatus(name, False, reason)


class ModelPlacement(Protocol):
    name: str
    placement: str  # "colocated" or "deployment"

    async def status(self) -> ModelStatus: ...

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False) -> BatchResult:
        """(n, T) ids and mask -> the request's result; `alone`: nothing else is in progress in the caller's
        process (a co-located model may then run it on the event loop)."""

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """A mirrored request's (n, C) logits, run only while the model has no work; None if it had or got some."""

    def preempt(self) -> None:
        """Stop a mirrored request's run in progress (this process's engines only)."""

    async def attention(self, ids: np.ndarray) -> AttentionResult: ...

    def busy(self) -> bool:
        """Whether this process has work of the model's in progress (a model unloaded is closed once it has none)."""

    def close(self) -> None:
        """Release what the model holds in this process, once it is no longer served."""


class Colocated:
    """The model's engine lives in the ingress replica: parse, validate, batch and run in one process."""

    placement = "colocated"

    def __init__(self, engine: ModelEngine) -> None:
        self.name = engine.name
        self._engine = engine

    async def status(self) -> ModelStatus:
        return self._engine.status()

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False) -> BatchResult:
        return await self._engine.infer(ids, mask, alone)

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        return await self._engine.spare_infer(ids, mask)

    def preempt(self) -> None:
        self._engine.preempt()

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        return await self._engine.attention(ids)

    def busy(self) -> bool:
        return self._engine.busy()

    def close(self) -> None:
        self._engine.close()


class Remote:
    """The model's own deployment; requests waiting here go as one Ray call per group when `coalesce` is on."""

    placement = "deployment"

    def __init__(self, name: str, handle: DeploymentHandle, coalescer: Coalescer | None) -> None:
        self.name = name
        self._handle = handle
        self._coalescer = coalescer

    async def status(self) -> ModelStatus:
        return await replica_status(self.name, self._handle)

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False) -> BatchResult:
        """`alone` says nothing here: the model's replica sees its own queue."""
        if self._coalescer is not None:
            return await self._coalescer.infer(ids, mask)
        return await answer_of(self.name, self._handle.infer.remote(ids, mask))

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """Its replica runs it only while it has no work of its own, and stops it when some comes; TimeoutError
        (a failed mirror) past SPARE_TIMEOUT_S."""
        try:
            async with asyncio.timeout(SPARE_TIMEOUT_S):
                return await answer_of(self.name, self._handle.spare_infer.remote(ids, mask))
        except ModelQueueFullError:  # its replica is full: no spare capacity
            return None

    def preempt(self) -> None:
        """Nothing to do here: its replica stops a mirrored run when work of its own arrives."""

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        return await answer_of(self.name, self._handle.attention.remote(ids))

    def busy(self) -> bool:
        return False  # its requests wait in its own replicas

    def close(self) -> None:
        """Nothing held here: its replicas go with a redeploy."""
