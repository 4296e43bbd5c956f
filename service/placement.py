"""Where a model runs, as the ingress sees it: `Colocated` (its engine in this process, no Ray call per request) or
`Remote` (its own Serve deployment, reached through a handle). Both answer `status`, `infer` and `attention` alike.
No torch.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from service.attention_api import AttentionResult
from service.batching import BatchResult
from service.coalescer import Coalescer
from service.engine import ModelEngine, ModelStatus
from service.errors import ModelQueueFullError, ReplicaLostError

STATUS_TIMEOUT_S = 5.0  # a model deployment without a live replica answers nothing; say so instead of hanging


class ModelPlacement(Protocol):
    name: str
    placement: str  # "colocated" or "deployment"

    async def status(self) -> ModelStatus: ...

    async def infer(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult: ...

    def infer_now(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult | None:
        """`infer`'s result without waiting, when the model can run the request at once on the caller's thread;
        None when it would have to wait (the request then goes through `infer`)."""

    async def attention(self, ids: np.ndarray) -> AttentionResult: ...


class Colocated:
    """The model's engine lives in the ingress replica: parse, validate, batch and run in one process."""

    placement = "colocated"

    def __init__(self, engine: ModelEngine) -> None:
        self.name = engine.name
        self._engine = engine

    async def status(self) -> ModelStatus:
        return self._engine.status()

    async def infer(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult:
        return await self._engine.infer(ids, mask)

    def infer_now(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult | None:
        return self._engine.infer_now(ids, mask)

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        return await self._engine.attention(ids)


async def _awaited(response):
    return await response


class Remote:
    """The model's own deployment; requests waiting here go as one Ray call per group when `coalesce` is on."""

    placement = "deployment"

    def __init__(self, name: str, handle: DeploymentHandle, coalescer: Coalescer | None) -> None:
        self.name = name
        self._handle = handle
        self._coalescer = coalescer

    async def status(self) -> ModelStatus:
        """Ask the model's replica (live); a replica that does not answer is reported as not ready."""
        try:
            return await asyncio.wait_for(_awaited(self._handle.status.remote()), STATUS_TIMEOUT_S)
        except TimeoutError:
            reason = f"no replica answered within {STATUS_TIMEOUT_S:g} s (starting, or failed at start: `serve status`)"
            return ModelStatus(self.name, False, reason)

    def infer_now(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult | None:
        return None  # a Ray call is always awaited

    async def infer(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult:
        if self._coalescer is not None:
            return await self._coalescer.infer(ids, mask)
        try:
            return await self._handle.infer.remote(ids, mask)
        except BackPressureError as exc:
            raise ModelQueueFullError(self.name) from exc
        except RayActorError as exc:
            raise ReplicaLostError(self.name) from exc

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        try:
            return await self._handle.attention.remote(ids)
        except RayActorError as exc:
            raise ReplicaLostError(self.name) from exc
