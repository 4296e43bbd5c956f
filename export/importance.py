"""Which heads matter: per layer and head, the gradient-based importance of Michel, Levy and Neubig (2019), the
expected |dL/d gate| of a gate on the head's output, normalised per layer, and the loss and accuracy with the head
alone masked.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from export.checkpoint import Checkpoint
from export.model import EncoderClassifier
from export.tasks import get_task
from export.train import Split, TrainConfig, encode_examples, evaluate, split_data, trimmed

SCORE_BATCH = 256  # rows per backward pass while scoring


@dataclass(frozen=True)
class HeadScore:
    layer: int
    head: int
    importance: float  # normalised within the layer (l2 norm 1 over its heads)
    raw_importance: float  # mean over examples of |dL/d gate|
    masked_loss: float  # validation loss with this head alone masked
    masked_acc: float  # a decoder's: next-token accuracy
    kv_head: int | None = None  # a decoder's: the key/value head this query head shares


@dataclass(frozen=True)
class HeadReport:
    model: str
    examples: int
    base_loss: float  # validation loss with every head
    base_acc: float
    scores: tuple[HeadScore, ...]  # layer by layer, head by head
    unit: str = "examples"  # what `examples` counts
    arch: str = "classifier"  # or "decoder": losses per token, accuracy of the next token


@contextlib.contextmanager
def gated(model: EncoderClassifier, gates: list[torch.Tensor]) -> Iterator[None]:
    """Within: layer i's head outputs are multiplied by gates[i], of shape (h_i,) or (B, h_i)."""
    layers = [block.attn for block in model.blocks]
    if len(gates) != len(layers):
        raise ValueError(f"{len(gates)} gates for {len(layers)} layers")
    for layer, gate in zip(layers, gates, strict=True):
        layer.head_gate = gate
    try:
        yield
    finally:
        for layer in layers:
            layer.head_gate = None


def heads_per_layer(model: EncoderClassifier) -> list[int]:
    return [block.attn.h for block in model.blocks]


def normalise(raw: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's scores divided by their l2 norm (Michel et al.), so layers compare on one scale."""
    return [scores / scores.norm().clamp(min=1e-20) for scores in raw]


def gradient_importance(model: EncoderClassifier, split: Split, batch_size: int = SCORE_BATCH) -> list[torch.Tensor]:
    """Per layer, (h_i,): the mean over examples of |dL/d gate| for a gate of 1 on each head's output (raw)."""
    model.eval()
    totals = [torch.zeros(h) for h in heads_per_layer(model)]
    n = len(split.labels)
    for start in range(0, n, batch_size):
        ids, mask, labels = trimmed(split, torch.arange(start, min(n, start + batch_size)))
        gates = [torch.ones(len(labels), h, requires_grad=True) for h in heads_per_layer(model)]  # (B, h_i) each
        with gated(model, gates):
            loss = F.cross_entropy(model(ids, mask), labels, reduction="sum")  # per-example gradients: sum
        grads = torch.autograd.grad(loss, gates)
        for total, grad in zip(totals, grads, strict=True):
            total += grad.abs().sum(dim=0)  # (h_i,)
    for scores in totals:
        if not torch.isfinite(scores).all():
            raise FloatingPointError(f"head importance is not finite: {scores.tolist()}")
    return [total / n for total in totals]


def masked_evaluate(model: EncoderClassifier, split: Split, layer: int, head: int) -> tuple[float, float]:
    """Validation loss and accuracy with head `head` of layer `layer` alone masked (its gate at 0)."""
    gates = [torch.ones(h) for h in heads_per_layer(model)]
    gates[layer][head] = 0.0
    with gated(model, gates):
        return evaluate(model, split)


def score_heads(model: EncoderClassifier, name: str, split: Split) -> HeadReport:
    """Importance and masked loss/accuracy of every head of `model` on `split`."""
    raw = gradient_importance(model, split)
    normalised = normalise(raw)
    base_loss, base_acc = evaluate(model, split)
    scores = []
    for layer, h in enumerate(heads_per_layer(model)):
        for head in range(h):
            loss, acc = masked_evaluate(model, split, layer, head)
            imp, raw_imp = float(normalised[layer][head]), float(raw[layer][head])
            scores.append(HeadScore(layer, head, imp, raw_imp, loss, acc))
    if not all(math.isfinite(s.masked_loss) for s in scores):
        raise FloatingPointError(f"{name}: a masked validation loss is not finite")
    return HeadReport(name, len(split.labels), base_loss, base_acc, tuple(scores))


def run_splits(checkpoint: Checkpoint) -> tuple[Split, Split]:
    """The training and validation splits of the checkpoint's run (same task, examples, seed and fraction)."""
    config = TrainConfig(**checkpoint.training)  # type: ignore[arg-type]
    task = get_task(config.task)
    return split_data(encode_examples(task, config.examples, config.seed), config.val_fraction)
