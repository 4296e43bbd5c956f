"""`POST /v1/models/{name}/attention`: a text's per-layer, per-head attention weights, from the model's
model.attn.onnx, loaded on first use in the model's own replica (the normal inference path never touches it). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from contract.attention_map import AttentionMapError, AttentionModel
from contract.metadata import ATTENTION_MODEL_FILE, ModelMetadata
from contract.tokenizer import ByteTokenizer
from service.errors import BadRequestError, ModelNotFoundError, NotReadyError
from service.inference import AttentionMap
from service.model_store import without_paths
from service.validation import texts_to_rows


class AttentionRequest(BaseModel):
    """One text; `layer` (0-based) picks one layer, omitted: every layer."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    layer: int | None = Field(None, json_schema_extra={"minimum": 0})


class AttentionResponse(BaseModel):
    """Per layer and head, each query token's weights over the key tokens: weights[layer][head][query][key]."""

    model: str
    heads: int
    head_dim: int
    tokens: list[str]
    layers: list[int]
    weights: list[list[list[list[float]]]]


class NoAttentionVariantError(ModelNotFoundError):
    """404: the model was exported without its attention variant (model.attn.onnx)."""


@dataclass(frozen=True)
class AttentionResult:
    """What the engine answers: the weights (layers, h, T, T), or why it has none (errors cross Ray as values):
    `missing` when the model was exported without the variant, else the variant is there but unusable."""

    weights: np.ndarray | None
    error: str = ""
    missing: bool = True


class AttentionVariant:
    """The replica's lazily opened session over model.attn.onnx."""

    def __init__(self, models_dir: str | Path, name: str, threads: int) -> None:
        self.folder = Path(models_dir) / name
        self.threads = threads
        self._model: AttentionModel | None = None

    def run(self, ids: np.ndarray) -> AttentionResult:
        """(1, T) int64 ids of one unpadded text -> its weights (layers, h, T, T)."""
        try:
            if self._model is None:
                self._model = AttentionModel(self.folder, self.threads)
            return AttentionResult(self._model.weights(ids[0].tolist()))
        except AttentionMapError as exc:
            missing = not (self.folder / ATTENTION_MODEL_FILE).is_file()
            return AttentionResult(None, self._without_paths(str(exc)), missing)
        except Exception as exc:  # ONNX Runtime cannot load or run the file (corrupt, truncated, wrong graph)
            why = f"ONNX Runtime cannot use {ATTENTION_MODEL_FILE}: {type(exc).__name__}: {exc}"
            return AttentionResult(None, self._without_paths(why), missing=False)

    def _without_paths(self, message: str) -> str:
        """Error text for a client: the server's folders replaced by the model's name, first line only."""
        return without_paths(message, self.folder).splitlines()[0]


def decode(text: str, layer: int | None, meta: ModelMetadata) -> tuple[np.ndarray, list[str], list[int]]:
    """The text's (1, T) ids, its token labels and the layers asked for; 400 for a layer out of range or a text
    over max_len."""
    if layer is not None and not 0 <= layer < meta.layers:
        raise BadRequestError(
            f"layer {layer} is out of range: {meta.name} has {meta.layers} layer(s): 0..{meta.layers - 1}"
        )
    rows = texts_to_rows([text], meta, max_rows=1)
    layers = list(range(meta.layers)) if layer is None else [layer]
    return rows.ids, ByteTokenizer(meta.max_len).tokens(text), layers


def weights_of(result: AttentionResult, meta: ModelMetadata, layers: list[int]) -> np.ndarray:
    """The weights (len(layers), h, T, T) of `layers`; 404 for a model without its attention variant, 503 for an
    unusable one."""
    if result.weights is None and not result.missing:
        raise NotReadyError(f"the attention variant of model {meta.name!r} cannot be used: {result.error}")
    if result.weights is None and meta.quantized_from:
        raise NoAttentionVariantError(
            f"model {meta.name!r} is {meta.precision}: its attention maps come from its fp32 source "
            f"{meta.quantized_from!r} (variants are made without the attention variant)"
        )
    if result.weights is None:
        raise NoAttentionVariantError(
            f"model {meta.name!r} has no attention variant ({ATTENTION_MODEL_FILE}): export it with "
            f"`mha-serving export --attention` or `mha-serving train` ({result.error})"
        )
    return result.weights[layers]  # (len(layers), h, T, T)


def response(attention: AttentionMap) -> dict[str, Any]:
    """AttentionResponse: per layer and head, each query token's weights over the key tokens."""
    meta = attention.metadata
    return {
        "model": meta.name,
        "heads": meta.heads,
        "head_dim": meta.head_dim,
        "tokens": attention.tokens,
        "layers": attention.layers,
        "weights": attention.weights.tolist(),  # [layer][head][query token][key token]
    }
