"""One model's serving engine: its ORT session, dynamic batcher, metrics and attention variant, in one process.

The same engine runs co-located in the ingress replica (no Ray call per request) or inside the model's own Serve
deployment; both placements share this code. No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from contract.metadata import ModelMetadata
from service.attention_api import AttentionResult, AttentionVariant
from service.batching import BatchPolicy, BatchResult, DynamicBatcher, merge
from service.config import DeploymentSettings
from service.errors import ModelFileError, NotReadyError
from service.inference import ModelStatus
from service.metrics import ReplicaMetrics, model_labels
from service.runtime import Runtime, load_runtime
from service.thread_names import ENGINE, RUNS, name_thread, threads_named

# A model lighter than this (multiply-adds x 2 per token) runs on `light_model_threads` ORT threads: its runs are too
# short for a second thread to pay for its wake-up and synchronisation (docs/benchmarks.md, "Threads").
LIGHT_MODEL_FLOPS = 4e6
ORT_THREADS = "ort-"  # the name prefix of a model's run threads (its ORT runs, batch merge and split)


def flops_per_token(meta: ModelMetadata) -> float:
    """Multiply-adds x 2 per token of every layer's projections (Q, K, V, output) and feed-forward; attention's
    T x T terms are left out (small at the lengths served here)."""
    ff_dim = meta.ff_dim or 4 * meta.d_model  # 0: a user's model that did not say; the usual 4 x d_model
    return 2.0 * meta.layers * (4 * meta.d_model * meta.attention_dim + 2 * meta.d_model * ff_dim)


@dataclass(frozen=True)
class EngineSettings:
    """How one engine runs its model (from the model's DeploymentSettings)."""

    backend: str  # auto, cpu or gpu: what was asked for
    threads: int  # ORT intra-op threads
    policy: BatchPolicy  # its max_runs is replaced by `runs`, resolved once the model is loaded (policy_for)
    spinning: str = "run"  # what ORT's waiting intra-op threads do: run, off or always (service/runtime.py)
    light_threads: int | None = None  # ORT threads for a model under LIGHT_MODEL_FLOPS on CPU; None: `threads`
    runs: int | None = None  # ORT runs in flight at once; None: one per intra-op thread on CPU, one on GPU
    gpu_wait: str = "auto"  # how this process waits for its GPU runs (service/cuda_wait.py)
    inline_on_gpu: bool = False  # a lone request may run inline on the GPU too

    @classmethod
    def of(cls, settings: DeploymentSettings, backend: str, placement: str, processes: int = 1) -> EngineSettings:
        """From a model's DeploymentSettings, for its placement (colocated or deployment; co-located in one of
        `processes` serving processes)."""
        policy = BatchPolicy(
            settings.max_batch_size,
            settings.max_queued_requests,
            settings.batch_wait_timeout_s,
            inline_max_s=settings.inline_run_max_ms / 1e3,
        )
        return cls(
            backend,
            settings.threads(placement, processes),
            policy,
            settings.ort_spinning,
            settings.light_model_threads,
            settings.max_concurrent_batches,
            settings.gpu_wait,
            settings.inline_on_gpu,
        )

    def threads_for(self, meta: ModelMetadata, backend: str) -> int:
        """The ORT threads this model should run on, once its metadata and active backend are known."""
        if self.light_threads is not None and backend == "cpu" and flops_per_token(meta) < LIGHT_MODEL_FLOPS:
            return min(self.threads, self.light_threads)
        return self.threads

    def policy_for(self, threads: int, backend: str) -> BatchPolicy:
        """The batch policy once the model's threads and active backend are known: how many runs may be in flight,
        and whether a short lone request may run on the event loop (on the GPU only when asked: measured on CPU)."""
        runs = self.runs or (threads if backend == "cpu" else 1)
        inline = self.policy.inline_max_s if backend == "cpu" or self.inline_on_gpu else 0.0
        return dataclasses.replace(self.policy, max_runs=runs, inline_max_s=inline)


def started_pool(workers: int, prefix: str, os_name: str = "") -> ThreadPoolExecutor:
    """A thread pool whose threads are all started now, each named `os_name` for the OS (service/thread_names.py).
    ThreadPoolExecutor starts one lazily whenever a task arrives while no thread is idle (or one is only about to
    be), so a replica's thread count would creep up to the maximum over hours, which a soak cannot tell from a leak."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    gate = threading.Barrier(workers, timeout=10)  # no task ends before all have started: each submit adds a thread

    def start() -> None:
        if os_name:
            name_thread(os_name)
        gate.wait()

    for started in [pool.submit(start) for _ in range(workers)]:
        started.result()  # every thread named before the first run
    return pool


class ModelEngine:
    """Triton-style lifecycle: load once at construction (a bad folder is reported, a backend that cannot be honoured
    raises BackendError), then `infer` per request; `status` backs readiness and the model list."""

    def __init__(self, models_dir: str, name: str, settings: EngineSettings) -> None:
        self.name = name
        with threads_named(f"{ENGINE}{name}"):  # the threads ORT (and CUDA) start for this model, named after it
            self._open(models_dir, name, settings)

    def _open(self, models_dir: str, name: str, settings: EngineSettings) -> None:
        self._runtime: Runtime | None = None
        self._error = ""
        try:
            args = (settings.spinning, settings.gpu_wait)
            rt = load_runtime(models_dir, name, settings.backend, settings.threads, *args)
            if (threads := settings.threads_for(rt.meta, rt.backend)) != rt.threads:  # a light model: opened again
                rt = load_runtime(models_dir, name, settings.backend, threads, *args)
            self._runtime = rt
        except ModelFileError as exc:  # BackendError is not caught: whoever holds the engine fails, saying why
            self._error = str(exc)
        rt = self._runtime
        threads = rt.threads if rt is not None else settings.threads
        policy = settings.policy_for(threads, rt.backend if rt is not None else "cpu")
        self._beside = rt  # the session of a run that starts beside another
        if rt is not None and rt.backend == "cpu" and (beside := max(1, rt.threads // policy.max_runs)) < rt.threads:
            # The threads shared out between the runs (one each by default): concurrent runs do not contend for the
            # same threads. Opened now, so that memory at ready is memory under load, and from the same file as the
            # main session a moment ago.
            self._beside = load_runtime(models_dir, name, "cpu", beside, settings.spinning)
        # The batcher's runners hold up to max_runs threads while requests keep coming; one more for attention.
        self._pool = started_pool(policy.max_runs + 1, f"{ORT_THREADS}{name}", f"{RUNS}{name}")
        self._metrics = ReplicaMetrics()
        self.labels = model_labels(rt.meta, rt.backend) if rt is not None else model_labels(None, "", name)
        self._attention = AttentionVariant(models_dir, name, threads)  # opened on first use only
        self._spare: ort.RunOptions | None = None  # the options of a mirrored request's run in progress
        self._batcher = None
        if rt is not None:
            self._batcher = DynamicBatcher(name, self._run, self._pool, policy, self._record_batch)

    def status(self) -> ModelStatus:
        rt = self._runtime
        if rt is None:
            return ModelStatus(self.name, False, self._error)
        return ModelStatus(self.name, True, rt.reason, rt.backend, rt.threads, rt.meta)

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False) -> BatchResult:
        """(n, T) int64 ids and mask, already validated -> this request's (n, C) logits and its costs. `alone`:
        the caller knows nothing else is in progress in this process (a short run may then be inline)."""
        if self._batcher is None:
            raise NotReadyError(f"model {self.name!r} is not ready: {self._error}")
        self.preempt()
        return await self._batcher.infer(ids, mask, alone)

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """(n, T) ids and mask of a mirrored request -> its (n, C) logits, run only while this model has no work;
        None when it had work, or when `preempt` stopped the run."""
        if self._batcher is None:
            raise NotReadyError(f"model {self.name!r} is not ready: {self._error}")
        if self._batcher.busy():
            return None
        ids, mask, _ = merge([(ids, mask)])  # (n, T'), trailing padding trimmed
        options = ort.RunOptions()
        self._spare = options
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._runtime.run, ids, mask, options)
        except Exception:
            if options.terminate:
                return None
            raise
        finally:
            self._spare = None

    def preempt(self) -> None:
        """Stop the mirrored request's run in progress, if any: ORT checks the flag between nodes."""
        if (options := self._spare) is not None:
            options.terminate = True

    async def attention(self, ids: np.ndarray) -> AttentionResult:
        """(1, T) ids of one text -> per-layer, per-head weights from model.attn.onnx; not on the `infer` path."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._attention.run, ids)

    def busy(self) -> bool:
        """Whether a run of this model is in flight or a request waits for one (a mirrored run included)."""
        return self._spare is not None or (self._batcher is not None and self._batcher.busy())

    def close(self) -> None:
        """Stop the run threads once no longer served (call when not `busy`); the sessions go with the engine."""
        self._pool.shutdown(wait=False)

    def _run(self, ids: np.ndarray, mask: np.ndarray, alone: bool) -> np.ndarray:
        """(N, T) ids and mask -> (N, C) logits: on every intra-op thread when the run started alone, else on its
        share of them."""
        return (self._runtime if alone else self._beside).run(ids, mask)

    def _record_batch(self, rows: int, tokens: int, run_s: float, waits: list[float]) -> None:
        self._metrics.batch(self.labels, rows, tokens, run_s, waits)
