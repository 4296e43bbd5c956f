"""The simple JSON API for people with curl: `{"text": ...}`, `{"texts": [...]}` or `{"input_ids": [[...]]}`.

Answers logits, probabilities, the predicted label(s) and the model's head configuration. No torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from export.metadata import ModelMetadata
from service.errors import BadRequestError
from service.validation import Rows, check_rows, int_matrix, ragged_to_rows, texts_to_rows


class PredictRequest(BaseModel):
    """Exactly one of `text`, `texts` or `input_ids` (with an optional `attention_mask` of the same shape)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    texts: list[str] | None = None
    input_ids: list[list[int]] | None = None
    attention_mask: list[list[int]] | None = None


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


def head_config(meta: ModelMetadata) -> dict[str, int]:
    return {"heads": meta.heads, "head_dim": meta.head_dim, "d_model": meta.d_model, "layers": meta.layers}


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
