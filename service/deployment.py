"""The model deployment: one Ray Serve deployment per model folder, loading its ORT session once at start.

Requests are merged by `@serve.batch` (rows, padded to the longest sequence) and run off the event loop. No torch.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from ray import serve
from ray.serve.deployment import Application

from export.metadata import ModelMetadata
from service import batching
from service.attention_api import AttentionResult, AttentionVariant
from service.config import DeploymentSettings
from service.errors import ModelFileError, NotReadyError
from service.metrics import ReplicaMetrics, model_labels
from service.runtime import Runtime, load_runtime


@dataclass(frozen=True)
class InferResult:
    """One request's logits and what it cost inside the replica (the metrics hooks read these)."""

    logits: np.ndarray  # (n, C) float32
    batch_rows: int  # rows in the ORT run this request shared
    queue_s: float  # from arrival in the replica to the start of its batch's ORT run
    run_s: float  # ORT run time of the whole batch


@dataclass(frozen=True)
class ModelStatus:
    """What a replica reports: readiness (with the reason when not ready), backend and the model's metadata."""

    name: str
    ready: bool
    reason: str
    backend: str = ""
    threads: int = 0
    metadata: ModelMetadata | None = None


def _rows(items: list[tuple[list[tuple[np.ndarray, np.ndarray]], float]]) -> int:
    return sum(ids.shape[0] for group, _ in items for ids, _ in group)


@serve.deployment
class ModelServer:
    """Triton-style lifecycle: load in `__init__` (a bad folder is reported, a backend that cannot be honoured
    fails the replica), then `infer` per request; `status` backs readiness and the model list."""

    def __init__(self, models_dir: str, name: str, backend: str, settings: DeploymentSettings) -> None:
        self.name = name
        self._runtime: Runtime | None = None
        self._error = ""
        try:
            self._runtime = load_runtime(models_dir, name, backend, settings.threads())
        except ModelFileError as exc:  # BackendError is not caught: the replica fails at start, saying why
            self._error = str(exc)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ort-{name}")
        self._metrics = ReplicaMetrics()
        rt = self._runtime
        self._labels = model_labels(rt.meta, rt.backend) if rt is not None else model_labels(None, "", name)
        self._attention = AttentionVariant(models_dir, name, settings.threads())  # opened on first use only
        self._max_batch_size = settings.max_batch_size
        self._batched.set_max_batch_size(settings.max_batch_size)
        self._batched.set_batch_wait_timeout_s(settings.batch_wait_timeout_s)

    def status(self) -> ModelStatus:
        rt = self._runtime
        if rt is None:
            return ModelStatus(self.name, False, self._error)
        return ModelStatus(self.name, True, rt.reason, rt.backend, rt.threads, rt.meta)

    async def infer(self, ids: np.ndarray, mask: np.ndarray) -> InferResult:
        """(n, T) int64 ids and mask, already validated by the ingress -> this request's (n, C) logits."""
        return (await self.infer_many([(ids, mask)]))[0]

    async def infer_many(self, requests: list[tuple[np.ndarray, np.ndarray]]) -> list[InferResult]:
        """Several requests' (ids, mask) in one call (the ingress groups them) -> one InferResult per request."""
        if self._runtime is None:
            raise NotReadyError(f"model {self.name!r} is not ready: {self._error}")
        arrived = time.perf_counter()
        if sum(ids.shape[0] for ids, _ in requests) <= self._max_batch_size:
            return await self._batched((requests, arrived))
        return list(await asyncio.gather(*(self._infer_large(ids, mask, arrived) for ids, mask in requests)))

    async def _infer_large(self, ids: np.ndarray, mask: np.ndarray, arrived: float) -> InferResult:
        """A request alone; with more rows than one batch holds, in batch-sized chunks batched like any other."""
        step = self._max_batch_size
        chunks = [self._batched(([(ids[i : i + step], mask[i : i + step])], arrived)) for i in range(0, len(ids), step)]
        parts: list[InferResult] = [group[0] for group in await asyncio.gather(*chunks)]
        logits = np.concatenate([p.logits for p in parts])  # (n, C)
        return InferResult(
            logits, max(p.batch_rows for p in parts), max(p.queue_s for p in parts), sum(p.run_s for p in parts)
        )

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        """(1, T) ids of one text -> per-layer, per-head weights from model.attn.onnx; not on the `infer` path."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._attention.run, ids)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0, batch_size_fn=_rows)
    async def _batched(self, items: list[tuple[list[tuple[np.ndarray, np.ndarray]], float]]) -> list[list[InferResult]]:
        requests = [pair for group, _ in items for pair in group]
        ids, mask, rows = batching.merge(requests)  # (N, T) each, T = longest in batch
        start = time.perf_counter()
        logits = await asyncio.get_running_loop().run_in_executor(self._pool, self._runtime.run, ids, mask)
        run_s = time.perf_counter() - start
        waits = [start - t0 for group, t0 in items for _ in group]  # per request: arrival to ORT start
        self._metrics.batch(self._labels, len(ids), ids.size, run_s, waits)
        parts = iter(batching.split(logits, rows))  # one (n_i, C) per request, in order
        return [[InferResult(next(parts), len(ids), start - t0, run_s) for _ in group] for group, t0 in items]


def model_deployment(
    name: str, models_dir: str, backend: str, settings: DeploymentSettings, num_gpus: float
) -> Application:
    """The bound deployment for one model folder, named after the model, with its resources and limits."""
    scaling: dict = {"num_replicas": settings.num_replicas}
    if settings.autoscaling is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": settings.autoscaling.model_dump()}
    return ModelServer.options(
        name=name,
        ray_actor_options={"num_cpus": settings.num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        **scaling,
    ).bind(models_dir, name, backend, settings)
