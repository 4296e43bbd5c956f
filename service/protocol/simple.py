"""The simple JSON API for people with curl: `{"text": ...}`, `{"texts": [...]}` or `{"input_ids": [[...]]}`.

Answers logits, probabilities, the predicted label(s) and the model's head configuration. No torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from contract.decoder_metadata import DecoderMetadata
from contract.metadata import CLASSIFIER, ModelMetadata
from service.errors import BadRequestError
from service.inference import InferenceRequest, InferenceResult, Listing, ModelStatus
from service.validation import MASK_VALUE, Bounds, Schema, int_matrix, ragged

NULL = {"type": "null"}


class PredictRequest(BaseModel):
    """Exactly one of `text`, `texts` or `input_ids` (with an optional `attention_mask` of the same shape)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str | None = None
    texts: list[str] | None = None
    input_ids: list[list[int]] | None = None
    attention_mask: list[list[int]] | None = None


def request_schema(bounds: Bounds) -> Schema:
    """PredictRequest's JSON Schema within `bounds`: exactly one of `text`, `texts`, `input_ids` (null counts as not
    sent); `attention_mask` only with `input_ids`, each row with a token. What JSON Schema cannot state is left to the
    service's 400s: the mask has the shape of `input_ids`, a text's UTF-8 bytes fit max_len."""
    text = bounds.text_schema()
    given = {"text": text, "texts": bounds.rows(text), "input_ids": bounds.rows(bounds.row(bounds.token_id()))}
    if not bounds.text:
        del given["text"], given["texts"]
    mask_row = bounds.row(MASK_VALUE) | {"contains": {"const": 1}}
    properties = {key: {"type": [kind, "null"]} for key, kind in (("text", "string"), ("texts", "array"))}
    properties |= {"input_ids": {"type": ["array", "null"]}, "attention_mask": {"anyOf": [bounds.rows(mask_row), NULL]}}
    one_of = []
    for key, schema in given.items():
        others = {other: NULL for other in ("text", "texts", "input_ids", "attention_mask") if other != key}
        if key == "input_ids":
            del others["attention_mask"]
        one_of.append({"required": [key], "properties": others | {key: schema}})
    return {"type": "object", "additionalProperties": False, "properties": properties, "oneOf": one_of}


class HeadConfig(BaseModel):
    heads: int  # the widest layer's, when a pruned model's layers differ
    head_dim: int
    d_model: int
    layers: int
    layer_heads: list[int]  # heads per layer
    precision: str  # fp32, int8 or fp16


class Timing(BaseModel):
    total_ms: float
    queue_ms: float
    run_ms: float
    batch_rows: int  # rows in the ORT run this request was part of


class PredictResponse(BaseModel):
    """Logits, probabilities and the predicted label per row (and `label` for `text`), with the head configuration."""

    model: str
    config: HeadConfig
    backend: str
    labels: list[str]
    logits: list[list[float]]
    probabilities: list[list[float]]
    predicted: list[str]
    label: str | None = None
    timing: Timing


class ModelInfo(BaseModel):
    """One model: its head configuration and backend once loaded, else `error` saying why it is not ready."""

    name: str
    ready: bool
    heads: int | None = None
    head_dim: int | None = None
    d_model: int | None = None
    layers: int | None = None
    layer_heads: list[int] | None = None
    precision: str | None = None
    quantized_from: str | None = None
    max_len: int | None = None
    vocab_size: int | None = None
    labels: list[str] | None = None
    task: str | None = None
    arch: str | None = Field(None, description="classifier, or decoder: served by the generation routes")
    kv_heads: int | None = Field(None, description="a decoder's key/value heads")
    context_length: int | None = Field(None, description="a decoder's prompt and generated tokens together")
    backend: str | None = None
    backend_reason: str | None = None
    threads: int | None = None
    error: str | None = None


class ShadowInfo(BaseModel):
    model: str
    fraction: float


class RouteInfo(BaseModel):
    """A route: served like a model, each request answered by one of its targets (weights), some mirrored."""

    name: str
    targets: dict[str, float]
    shadow: ShadowInfo | None = None
    ready: bool


class ModelList(BaseModel):
    """Every configured model, ready or not, and every route."""

    models: list[ModelInfo]
    routes: list[RouteInfo] = []


def to_request(request: PredictRequest) -> InferenceRequest:
    """The decoded request: exactly one of `text`, `texts` or `input_ids` (padded when ragged, without a mask)."""
    given = [k for k in ("text", "texts", "input_ids") if getattr(request, k) is not None]
    if len(given) != 1:
        raise BadRequestError(f"send exactly one of 'text', 'texts' or 'input_ids' (got {given or 'none'})")
    if request.attention_mask is not None and request.input_ids is None:
        raise BadRequestError("'attention_mask' goes with 'input_ids'")
    if request.text is not None:
        return InferenceRequest(texts=[request.text])
    if request.texts is not None:
        return InferenceRequest(texts=request.texts)
    if request.attention_mask is None:
        ids, mask = ragged(request.input_ids)
        return InferenceRequest(ids, mask)
    ids = int_matrix("input_ids", request.input_ids)
    return InferenceRequest(ids, int_matrix("attention_mask", request.attention_mask))


def softmax(logits: np.ndarray) -> np.ndarray:
    """(B, C) -> (B, C) probabilities, computed stably."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def head_config(meta: ModelMetadata) -> dict[str, Any]:
    config = {"heads": meta.heads, "head_dim": meta.head_dim, "d_model": meta.d_model, "layers": meta.layers}
    return {**config, "layer_heads": list(meta.heads_per_layer), "precision": meta.precision}


def predict_response(request: PredictRequest, result: InferenceResult, total_s: float) -> dict[str, Any]:
    """The answer to a predict: logits, probabilities and labels per row, the head configuration and the timing."""
    meta, logits = result.metadata, result.logits
    labels = [meta.labels[i] for i in logits.argmax(axis=1)]
    out: dict[str, Any] = {
        "model": meta.name,
        "config": head_config(meta),
        "backend": result.backend,
        "labels": list(meta.labels),
        "logits": logits.tolist(),
        "probabilities": softmax(logits).tolist(),
        "predicted": labels,
    }
    if request.text is not None:
        out["label"] = labels[0]
    out["timing"] = {
        "total_ms": total_s * 1e3,
        "queue_ms": result.queue_s * 1e3,
        "run_ms": result.run_s * 1e3,
        "batch_rows": result.batch_rows,
    }
    return out


def model_info(status: ModelStatus) -> dict[str, Any]:
    """A model's entry in the model list (ModelInfo)."""
    out: dict[str, Any] = {"name": status.name, "ready": status.ready}
    meta = status.metadata
    if meta is None:
        return {**out, "error": status.reason}
    if isinstance(meta, DecoderMetadata):  # a generator: its key/value heads and context length
        config = {"heads": meta.heads, "head_dim": meta.head_dim, "d_model": meta.d_model, "layers": meta.layers}
        out.update(config, precision=meta.precision, max_len=meta.max_len, vocab_size=meta.vocab_size, task=meta.task)
        out.update(arch=meta.arch, kv_heads=meta.kv_heads, context_length=meta.max_len)
        return out | {"backend": status.backend, "backend_reason": status.reason, "threads": status.threads}
    out.update(head_config(meta))
    out.update(arch=CLASSIFIER)
    out.update(
        quantized_from=meta.quantized_from,
        max_len=meta.max_len,
        vocab_size=meta.vocab_size,
        labels=list(meta.labels),
        task=meta.task,
    )
    return out | {"backend": status.backend, "backend_reason": status.reason, "threads": status.threads}


def model_list(listing: Listing) -> dict[str, list[dict[str, Any]]]:
    """Every model with its head configuration, and every route with its targets and shadow (ModelList)."""
    routes = [plan.describe(ready) for plan, ready in listing.routes]
    return {"models": [model_info(s) for s in listing.statuses], "routes": routes}
