"""Latency of a sweep's exported models: p50 per call at batch 1 and 32, all models timed in interleaved rounds so they
share the machine's noise; in-process ONNX Runtime, or a running service's /v1/models/{name}/predict. And each model's
int8 twin (ONNX Runtime's dynamic quantization), with its accuracy against the fp32 model, to be timed in the same
rounds. Torch-free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from contract.metadata import ATTENTION_MASK, INPUT_IDS, MODEL_FILE
from contract.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from export.quantize import GateData, Int8Plan

BATCHES = (1, 32)
ROUNDS = 5  # every model is timed once per round, round after round
WARMUP = 5  # untimed calls per model and batch size before the first round

Caller = Callable[[int], None]  # one inference call at the given batch size
Key = TypeVar("Key", bound=Hashable)  # what a timed model is known by: h, heads removed, (h, precision)
INT8_MODE = "dynamic"  # weights int8 ahead of time, activations quantized per call: no calibration data to choose


class TimingError(RuntimeError):
    """A model could not be timed: the service is unreachable or answered with an error."""


def in_process_caller(
    folder: Path, texts: list[str], max_len: int, threads: int, providers: list[str] | None = None
) -> Caller:
    """Calls of the folder's model.onnx with ONNX Runtime (`threads` intra-op threads; CPU unless `providers`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    providers = providers or ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(Path(folder) / MODEL_FILE), options, providers=providers)
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


def timed_rounds(callers: dict[Key, Caller], repeats: int) -> dict[tuple[Key, int], list[list[float]]]:
    """(key, batch) -> seconds per call, one list per round; every model timed once per round, in the callers'
    order, after WARMUP untimed calls."""
    for call in callers.values():
        for batch in BATCHES:
            for _ in range(WARMUP):
                call(batch)
    samples: dict[tuple[Key, int], list[list[float]]] = {(h, b): [] for h in callers for b in BATCHES}
    for _ in range(ROUNDS):
        for h, call in callers.items():
            for batch in BATCHES:
                calls = []
                for _ in range(calls_per_round(batch, repeats)):
                    start = time.perf_counter()
                    call(batch)
                    calls.append(time.perf_counter() - start)
                samples[h, batch].append(calls)
    return samples


def time_models(callers: dict[Key, Caller], repeats: int) -> dict[Key, tuple[float, ...]]:
    """Key (h, ...) -> p50 milliseconds per call at each batch size of BATCHES, in the callers' order per round."""
    samples = timed_rounds(callers, repeats)
    every = {key: [t for calls in rounds for t in calls] for key, rounds in samples.items()}
    return {h: tuple(statistics.median(every[h, b]) * 1e3 for b in BATCHES) for h in callers}


@dataclass(frozen=True)
class Int8Twin:
    """An exported model's dynamic-int8 quantization and its figures against the fp32 model on the same inputs."""

    folder: Path  # holds the int8 model.onnx (nothing else: enough for in_process_caller)
    accuracy: float | None  # fraction correct on the data's labels (None without labels), as the lab's fp32 columns
    fp32_accuracy: float | None  # the fp32 model in ONNX Runtime on the same data: the int8 drop is against this
    agreement: float  # fraction of inputs whose argmax equals the fp32 model's
    max_logit_diff: float
    data: str  # where the inputs come from, in words


def int8_twin(folder: Path, scratch: Path, data: GateData, plan: Int8Plan) -> Int8Twin:
    """Quantize `folder`'s model.onnx into `scratch/<folder name>-int8` and measure both models on `data`.

    No quality gate (export/quantize.py's make_variant has one): the lab's job is to show what int8 costs, so a model
    that int8 hurts is measured and reported, not refused.
    """
    from export.quantize import compare, logits_of, open_session, to_int8

    target = Path(scratch) / f"{Path(folder).name}-int8"
    target.mkdir(parents=True, exist_ok=True)
    to_int8(Path(folder) / MODEL_FILE, target / MODEL_FILE, INT8_MODE, plan)  # QuantizeError if it fails
    logits = [logits_of(open_session(f / MODEL_FILE, ["CPUExecutionProvider"]), data) for f in (Path(folder), target)]
    gate = compare(logits[0], logits[1], data, "cpu")  # accuracies in percent; the lab's columns are fractions
    accuracy = None if gate.accuracy is None else gate.accuracy / 100
    fp32_accuracy = None if gate.fp32_accuracy is None else gate.fp32_accuracy / 100
    return Int8Twin(target, accuracy, fp32_accuracy, gate.agreement, gate.max_logit_diff, data.source)
