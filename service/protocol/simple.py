"""The simple JSON API for people with curl: `{"text": ...}`, `{"texts": [...]}` or `{"input_ids": [[...]]}`.

Answers logits, probabilities, the predicted label(s) and the model's head configuration. No torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from contract.metadata import ModelMetadata
from service.errors import BadRequestError
from service.validation import Rows, check_rows, int_matrix, ragged_to_rows, texts_to_rows


def _one_of(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema branch "`key` given (not null); `attention_mask` only with `input_ids`"."""
    properties = {key: schema} if key == "input_ids" else {key: schema, "attention_mask": {"type": "null"}}
    return {"required": [key], "properties": properties}


ROW = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}  # token ids, one sequence
IDS = {"type": "array", "minItems": 1, "items": ROW}
EXACTLY_ONE = [_one_of("text", {"type": "string"}), _one_of("texts", {"type": "array"}), _one_of("input_ids", IDS)]


class PredictRequest(BaseModel):
    """Exactly one of `text`, `texts` or `input_ids` (with an optional `attention_mask` of the same shape)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"oneOf": EXACTLY_ONE})
    text: str | None = None
    texts: list[str] | None = Field(None, json_schema_extra={"minItems": 1})
    input_ids: list[list[int]] | None = None
    attention_mask: list[list[int]] | None = Field(
        None, json_schema_extra={"items": {"type": "array", "items": {"enum": [0, 1]}}}
    )


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


class ModelList(BaseModel):
    """Every configured model, ready or not."""

    models: list[ModelInfo]


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
