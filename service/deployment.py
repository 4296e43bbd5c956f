"""The per-deployment placement: one Ray Serve deployment per model, holding that model's ModelEngine (a
classifier) or its generation engine (a decoder, streaming its token events back through the handle).

For GPU head configurations, or one that must scale on its own; the ingress reaches it through a Ray call. No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
from ray import serve
from ray.serve.deployment import Application

from service.attention_api import AttentionResult
from service.batching import BatchResult
from service.config import DeploymentSettings
from service.decoder_placement import ColocatedDecoder
from service.engine import EngineSettings, ModelEngine, ModelStatus
from service.generate import GenerateRequest, GenerationSettings, TokenEvent
from service.generation_metrics import EngineGauges, generation_labels
from service.metrics import GAUGE_REFRESH_S, model_labels

logger = logging.getLogger(__name__)
# Requests past its engine's limits that a decoder's replica takes at once, to refuse them itself: a burst beyond
# the engine's room gets its 503s within a step, not after Serve's backoff (up to 0.5 s a retry); status calls pass.
REFUSING_SLOTS = 16


@serve.deployment
class ModelServer:
    """A replica holding one engine: `status`, `infer_many` (a group of requests coalesced by the ingress) and
    `attention`. A backend that cannot be honoured fails the replica at start, saying why."""

    def __init__(self, models_dir: str, name: str, backend: str, settings: DeploymentSettings) -> None:
        self._engine = ModelEngine(models_dir, name, EngineSettings.of(settings, backend, "deployment"))

    def status(self) -> ModelStatus:
        return self._engine.status()

    async def infer(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult:
        """(n, T) int64 ids and mask, already validated by the ingress -> this request's (n, C) logits. Never
        inline: Ray calls queued for this replica's event loop are not seen until they run."""
        return await self._engine.infer(ids, mask)

    async def infer_many(self, requests: list[tuple[np.ndarray, np.ndarray]]) -> list[BatchResult | Exception]:
        """Several requests' (ids, mask) in one call (the ingress groups them) -> a result or an error per request."""
        return list(await asyncio.gather(*(self._engine.infer(i, m) for i, m in requests), return_exceptions=True))

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """A mirrored request's (n, C) logits, run only while this replica has no work (service/shadow.py)."""
        return await self._engine.spare_infer(ids, mask)

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        return await self._engine.attention(ids)


def model_deployment(
    name: str, models_dir: str, backend: str, settings: DeploymentSettings, num_gpus: float
) -> Application:
    """The bound deployment for one model folder, named after the model, with its resources and limits."""
    return ModelServer.options(**_replicas(name, settings, num_gpus)).bind(models_dir, name, backend, settings)


@serve.deployment
class DecoderServer:
    """A replica holding one decoder's generation engine: `generate` streams a request's token events (called
    through a handle with `stream=True`); the ingress closing that stream (a client gone) cancels the call, which
    ends the sequence here within a step. A backend that cannot be honoured fails the replica at start."""

    def __init__(self, models_dir: str, name: str, settings: GenerationSettings) -> None:
        self._decoder = ColocatedDecoder.open(models_dir, name, settings)
        self._gauges = EngineGauges()
        self._gauge_refresher: asyncio.Task | None = None

    async def status(self) -> ModelStatus:
        self._start_gauge_refresher()  # the ingress asks before its first request, and on every admission
        return await self._decoder.status()

    async def generate(self, request: GenerateRequest, age_s: float = 0.0) -> AsyncIterator[TokenEvent]:
        """The request's token events, the last with its finish_reason (the prompt is token ids: the ingress
        encoded and checked it); its refusal (a ServiceError) is raised before the first. `age_s`: how long ago its
        head arrived at the ingress, so that queue time and time to first token count from then here too."""
        self._start_gauge_refresher()
        stream = self._decoder.submit(dataclasses.replace(request, arrived=time.perf_counter() - age_s))
        try:
            async for event in stream:
                yield event
        finally:
            stream.cancel()

    def _start_gauge_refresher(self) -> None:
        if self._gauge_refresher is None and self._decoder.engine is not None:
            self._gauge_refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        """The engine's running and waiting requests and KV cache usage, set again every GAUGE_REFRESH_S (this
        replica holds the engine: the ingress has no view of it), with the labels the ingress gives the decoder."""
        engine = self._decoder.engine
        labels = generation_labels(model_labels(engine.meta, engine.runtime.backend), engine.meta.kv_heads)
        while True:
            try:
                self._gauges.set(labels, engine.state())
            except Exception:  # one failed export must not stop the gauges for good
                logger.exception("refreshing the engine's gauges failed; trying again in %g s", GAUGE_REFRESH_S)
            await asyncio.sleep(GAUGE_REFRESH_S)

    def __del__(self) -> None:
        self._decoder.close()


def decoder_deployment(
    name: str, models_dir: str, settings: DeploymentSettings, generation: GenerationSettings, num_gpus: float
) -> Application:
    """The bound deployment for one decoder folder, named after the model: replicas and resources from its
    deployment settings, the engine from the `generate` block, and Serve's limits from the engine's
    (`decoder_limits`)."""
    options = _replicas(name, settings, num_gpus) | decoder_limits(generation)
    return DecoderServer.options(**options).bind(models_dir, name, generation)


def decoder_limits(generation: GenerationSettings) -> dict:
    """Serve's limits for a decoder's replica, so that its engine's queue is the only one: a replica takes every
    request its engine can hold (max_running + max_waiting) and REFUSING_SLOTS more, which the engine refuses at
    once (503: its queue is full) instead of their waiting in Serve's queue, where queue_timeout_s and the waiting
    gauge would not see them. Serve counts a request as queued while it picks a replica, so its queue is sized for
    a burst that the engines have room for, not as a wait."""
    held = generation.max_running + generation.max_waiting
    return {"max_ongoing_requests": held + REFUSING_SLOTS, "max_queued_requests": held}


def _replicas(name: str, settings: DeploymentSettings, num_gpus: float) -> dict:
    """A model deployment's Serve options: named after the model, its resources, limits and scaling."""
    return {
        "name": name,
        "ray_actor_options": {"num_cpus": settings.num_cpus, "num_gpus": num_gpus},
        "max_ongoing_requests": settings.max_ongoing_requests,
        "max_queued_requests": settings.max_queued_requests,
        "health_check_period_s": settings.health_check_period_s,
        **settings.scaling(),
    }
