"""The simple JSON API for people with curl: `{"text": ...}`, `{"texts": [...]}` or `{"input_ids": [[...]]}`.

Answers logits, probabilities, the predicted label(s) and the model's head configuration. No torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from contract.metadata import ModelMetadata
from service.errors import BadRequestError
from service.validation import MASK_VALUE, Bounds, Rows, Schema, check_rows, int_matrix, ragged_to_rows, texts_to_rows

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


def decode(request: PredictRequest, meta: ModelMetadata, max_rows: int) -> Rows:
    given = [k for k in ("text", "texts", "input_ids") if getattr(request, k) is not None]
    if len(given) != 1:
        raise BadRequestError(f"send exactly one of 'text', 'texts' or 'input_ids' (got {given or 'none'})")
    if request.attention_mask is not None and request.input_ids is None:
        raise BadRequestError("'attention_mask' goes with 'input_ids'")
    if request.text is not None:
        return texts_to_rows([request.text], meta, max_rows)
    if request.texts is not None:
        return texts_to_rows(request.texts, meta, max_rows)
    if request.attention_mask is None:
        return ragged_to_rows(request.input_ids, meta, max_rows)
    ids = int_matrix("input_ids", request.input_ids)
    return check_rows(ids, int_matrix("attention_mask", request.attention_mask), meta, max_rows)


def softmax(logits: np.ndarray) -> np.ndarray:
    """(B, C) -> (B, C) probabilities, computed stably."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def head_config(meta: ModelMetadata) -> dict[str, Any]:
    config = {"heads": meta.heads, "head_dim": meta.head_dim, "d_model": meta.d_model, "layers": meta.layers}
    return {**config, "layer_heads": list(meta.heads_per_layer), "precision": meta.precision}


def predict_response(
    request: PredictRequest, meta: ModelMetadata, backend: str, logits: np.ndarray, timing: dict[str, float]
) -> dict[str, Any]:
    probs = softmax(logits)
    labels = [meta.labels[i] for i in logits.argmax(axis=1)]
    out: dict[str, Any] = {
        "model": meta.name,
        "config": head_config(meta),
        "backend": backend,
        "labels": list(meta.labels),
        "logits": logits.tolist(),
        "probabilities": probs.tolist(),
        "predicted": labels,
    }
    if request.text is not None:
        out["label"] = labels[0]
    out["timing"] = timing
    return out
