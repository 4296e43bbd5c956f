"""Latency of a sweep's exported models: p50 per call at batch 1 and 32, all models timed in interleaved rounds so they
share the machine's noise; in-process ONNX Runtime, or a running service's /v1/models/{name}/predict. Torch-free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from contract.metadata import ATTENTION_MASK, INPUT_IDS, MODEL_FILE
from contract.tokenizer import ByteTokenizer

BATCHES = (1, 32)
ROUNDS = 5  # every model is timed once per round, round after round
WARMUP = 5  # untimed calls per model and batch size before the first round

Caller = Callable[[int], None]  # one inference call at the given batch size


class TimingError(RuntimeError):
    """A model could not be timed: the service is unreachable or answered with an error."""


def in_process_caller(folder: Path, texts: list[str], max_len: int, threads: int) -> Caller:
    """Calls of the folder's model.onnx with ONNX Runtime on CPU (`threads` intra-op threads)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(Path(folder) / MODEL_FILE), options, providers=["CPUExecutionProvider"])
    tokenizer = ByteTokenizer(max_len)
    feeds = {}
    for batch in BATCHES:
        ids, mask = tokenizer.encode_batch(texts[:batch])  # padded to the longest text of the batch
        feeds[batch] = {INPUT_IDS: np.array(ids, dtype=np.int64), ATTENTION_MASK: np.array(mask, dtype=np.int64)}
    return lambda batch: session.run(None, feeds[batch])


def service_caller(client, url: str, name: str, texts: list[str]) -> Caller:
    """Requests to a running service's simple JSON endpoint (`client`: an httpx.Client)."""
    import httpx

    endpoint = f"{url.rstrip('/')}/v1/models/{name}/predict"
    bodies = {b: {"text": texts[0]} if b == 1 else {"texts": texts[:b]} for b in BATCHES}

    def call(batch: int) -> None:
        try:
            response = client.post(endpoint, json=bodies[batch])
        except httpx.HTTPError as exc:
            raise TimingError(f"cannot reach {endpoint}: {exc}") from exc
        if response.status_code != 200:
            raise TimingError(f"{endpoint} answered {response.status_code}: {response.text[:300]}")

    return call


def calls_per_round(batch: int, repeats: int) -> int:
    """`repeats` timed calls at batch 1 (a quarter of them, at least 10, at larger batches), split over ROUNDS."""
    total = repeats if batch == 1 else max(10, repeats // 4)
    return max(1, total // ROUNDS)


def time_models(callers: dict[int, Caller], repeats: int) -> dict[int, tuple[float, ...]]:
    """h -> p50 milliseconds per call at each batch size of BATCHES."""
    for call in callers.values():
        for batch in BATCHES:
            for _ in range(WARMUP):
                call(batch)
    samples: dict[tuple[int, int], list[float]] = {(h, b): [] for h in callers for b in BATCHES}
    for _ in range(ROUNDS):
        for h, call in callers.items():
            for batch in BATCHES:
                for _ in range(calls_per_round(batch, repeats)):
                    start = time.perf_counter()
                    call(batch)
                    samples[h, batch].append(time.perf_counter() - start)
    return {h: tuple(statistics.median(samples[h, b]) * 1e3 for b in BATCHES) for h in callers}
