"""Which query heads of a trained decoder matter: Michel et al.'s gate importance (export/importance.py) against the
language-modelling loss on the held-out docs-lm windows, one example per window, and the validation loss and
next-token accuracy with each query head alone masked. Under GQA a key/value head is shared, so only query heads are
gated."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from export.decoder import DecoderLM
from export.docs_corpus import load_corpus
from export.importance import HeadReport, HeadScore, gated, normalise
from export.lm_checkpoint import DecoderCheckpoint
from export.lm_train import windows

SCORE_BATCH = 64  # windows per backward pass while scoring


def val_windows(checkpoint: DecoderCheckpoint, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (N, T) of the training run's held-out split, in non-overlapping windows of its context
    length (the windows `mha-serving train` validated on), the first `limit` of them."""
    config = checkpoint.training
    ids = torch.tensor(load_corpus(config.val_fraction).val.ids)
    starts = torch.arange(0, len(ids) - config.max_len, config.max_len)[:limit]
    return windows(ids, starts, config.max_len)


def _window_losses(model: DecoderLM, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window (B,): mean cross-entropy per token, and tokens predicted right (argmax)."""
    B, T = x.shape
    logits, _ = model(x, torch.ones(B, T, dtype=torch.int64), torch.arange(T)[None].expand(B, T))  # (B, T, V)
    loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)  # (B,)
    return loss, (logits.argmax(dim=-1) == y).sum(dim=1)


def gradient_importance(model: DecoderLM, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, (h,): the mean over windows of |dL/d gate| for a gate of 1 on each query head's output (raw)."""
    model.eval()
    heads = [block.attn.h for block in model.blocks]
    totals = [torch.zeros(h) for h in heads]
    for start in range(0, len(x), SCORE_BATCH):
        xb, yb = x[start : start + SCORE_BATCH], y[start : start + SCORE_BATCH]
        gates = [torch.ones(len(xb), h, requires_grad=True) for h in heads]  # (B, h) each
        with gated(model, gates):  # type: ignore[arg-type]  # any model whose blocks have .attn
            loss = _window_losses(model, xb, yb)[0].sum()  # per-window gradients: sum
        for total, grad in zip(totals, torch.autograd.grad(loss, gates), strict=True):
            total += grad.abs().sum(dim=0)  # (h,)
    if not all(torch.isfinite(t).all() for t in totals):
        raise FloatingPointError(f"head importance is not finite: {[t.tolist() for t in totals]}")
    return [total / len(x) for total in totals]


@torch.no_grad()
def evaluate(model: DecoderLM, x: torch.Tensor, y: torch.Tensor, gates: list[torch.Tensor] | None = None):
    """(validation loss per token, next-token accuracy), with `gates` on the query heads if given."""
    gates = gates or [torch.ones(block.attn.h) for block in model.blocks]
    loss, right = 0.0, 0
    with gated(model, gates):  # type: ignore[arg-type]
        for start in range(0, len(x), SCORE_BATCH):
            batch = slice(start, start + SCORE_BATCH)
            window_loss, window_right = _window_losses(model, x[batch], y[batch])
            loss += float(window_loss.sum())
            right += int(window_right.sum())
    return loss / len(x), right / y.numel()


def score_decoder_heads(checkpoint: DecoderCheckpoint, name: str, limit: int | None = None) -> HeadReport:
    """Importance, masked loss and masked next-token accuracy of every query head; each score names its kv head."""
    model = checkpoint.model
    x, y = val_windows(checkpoint, limit)
    raw = gradient_importance(model, x, y)
    normalised = normalise(raw)
    base_loss, base_acc = evaluate(model, x, y)
    group = model.config.heads // model.config.resolved_kv_heads
    scores = []
    for layer, block in enumerate(model.blocks):
        for head in range(block.attn.h):
            gates = [torch.ones(b.attn.h) for b in model.blocks]
            gates[layer][head] = 0.0
            loss, acc = evaluate(model, x, y, gates)
            imp, raw_imp = float(normalised[layer][head]), float(raw[layer][head])
            scores.append(HeadScore(layer, head, imp, raw_imp, loss, acc, kv_head=head // group))
    if not all(math.isfinite(s.masked_loss) for s in scores):
        raise FloatingPointError(f"{name}: a masked validation loss is not finite")
    unit = f"windows of {x.shape[1]} tokens"
    return HeadReport(name, len(x), base_loss, base_acc, tuple(scores), unit=unit, arch="decoder")
