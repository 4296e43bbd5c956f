"""What the data plane takes and answers, whatever the transport: a decoded inference request (token ids and mask,
or texts, not yet checked against a model) and its result. No torch, no transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.metadata import ModelMetadata
from service.routes import RoutePlan

MODEL_VERSION = "1"  # every model has one version (the Open Inference Protocol's, Triton's)


@dataclass(frozen=True)
class ModelStatus:
    """What an engine reports: readiness (with the reason when not ready), backend and the model's metadata."""

    name: str
    ready: bool
    reason: str
    backend: str = ""
    threads: int = 0
    metadata: ModelMetadata | None = None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One request's input: `ids` (with `mask`, or all tokens when None) or `texts`; the model checks it."""

    ids: np.ndarray | None = None  # (B, T) int64
    mask: np.ndarray | None = None  # (B, T) int64, 1 token / 0 padding
    texts: list[str] | None = None
    outputs: tuple[str, ...] = ()  # output names asked for; empty: every output


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """A request's answer: the model that gave it (a route's target), its logits and what the run cost."""

    model: str
    metadata: ModelMetadata
    backend: str
    logits: np.ndarray  # (B, C) float32
    queue_s: float  # from arrival to the start of its batch's run
    run_s: float  # the batch's run time
    batch_rows: int  # rows in the run this request shared


@dataclass(frozen=True, slots=True)
class AttentionMap:
    """One text's attention weights: per layer asked for, per head, each query token's weights over the keys."""

    metadata: ModelMetadata
    tokens: list[str]
    layers: list[int]
    weights: np.ndarray  # (len(layers), h, T, T)


@dataclass(frozen=True)
class Listing:
    """Every model's status, and every route with whether each of its targets is ready."""

    statuses: list[ModelStatus]
    routes: list[tuple[RoutePlan, bool]]
