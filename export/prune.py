"""Pruning heads: a model rebuilt with fewer heads per layer (smaller QKV and output projections, head_dim unchanged),
the heads to drop chosen least important first (re-scored after each step) or at random, and an optional short
fine-tune of the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from export.importance import gradient_importance, normalise
from export.model import EncoderClassifier
from export.train import Split, batches, trimmed

ORDERS = ("importance", "random")


class PruneError(ValueError):
    """A drop fraction that cannot work: outside (0, 1), removing no head, or leaving a layer without heads."""


@dataclass(frozen=True)
class PruneSettings:
    """How heads are pruned and the result fine-tuned (`mha-serving prune`'s flags, the candidates' settings)."""

    order: str = "importance"
    seed: int = 0  # random order's, and fine-tuning's batch order
    step: int = 1  # heads removed between re-scorings
    finetune_steps: int = 0
    finetune_lr: float = 3e-4
    attention: bool = True  # also export model.attn.onnx (when every layer keeps the same count)


@dataclass(frozen=True)
class Pruned:
    """A model with `removed` heads fewer; `kept[i]` are the original indices of layer i's remaining heads."""

    model: EncoderClassifier
    removed: int
    kept: tuple[tuple[int, ...], ...]
    order: tuple[tuple[int, int], ...]  # (layer, original head) in the order they were removed


def heads_to_remove(drop: list[float], layer_heads: list[int]) -> dict[float, int]:
    """Each drop fraction -> how many heads it removes (rounded); PruneError names the fix for one that cannot."""
    total, layers = sum(layer_heads), len(layer_heads)
    counts = {}
    for fraction in drop:
        if not 0.0 < fraction < 1.0:
            raise PruneError(f"--drop {fraction:g} is outside (0, 1): give the fraction of heads to remove, e.g. 0.25")
        n = round(fraction * total)
        if n < 1:
            raise PruneError(f"--drop {fraction:g} removes none of {total} heads; use at least {1 / total:.3g}")
        if n > total - layers:
            raise PruneError(
                f"--drop {fraction:g} would remove {n} of {total} heads and leave a layer without heads (each of the "
                f"{layers} layer(s) keeps at least one); use at most {(total - layers) / total:.3g}"
            )
        same = [f for f, m in counts.items() if m == n]
        if same:
            raise PruneError(f"--drop {same[0]:g} and {fraction:g} both remove {n} of {total} heads; give one of them")
        counts[fraction] = n
    return counts


def prune_model(model: EncoderClassifier, keep: list[list[int]]) -> EncoderClassifier:
    """A new model holding only the heads `keep[i]` (indices into layer i's current heads); everything else copied."""
    old = model.config
    layer_heads = tuple(len(k) for k in keep)
    config = replace(
        old,
        heads=max(layer_heads),
        head_dim=old.resolved_head_dim,
        layer_heads=layer_heads,
        pruned_from=old.pruned_from or old.name,
    )
    state = model.state_dict()
    for i, (block, heads) in enumerate(zip(model.blocks, keep, strict=True)):
        smaller = block.attn.keep_heads(heads)
        state.update({f"blocks.{i}.attn.{key}": value for key, value in smaller.state_dict().items()})
    pruned = EncoderClassifier(config)
    pruned.load_state_dict(state)
    return pruned.eval()


def _choose(scores: list[torch.Tensor], n: int) -> list[tuple[int, int]]:
    """The n lowest-scoring (layer, head) pairs, never taking a layer's last head."""
    left = [len(s) for s in scores]
    ranked = sorted((float(s[j]), i, j) for i, s in enumerate(scores) for j in range(len(s)))
    chosen = []
    for _, i, j in ranked:
        if len(chosen) == n:
            break
        if left[i] > 1:
            chosen.append((i, j))
            left[i] -= 1
    return chosen


def iterative_prune(
    model: EncoderClassifier, split: Split, targets: list[int], order: str = "importance", seed: int = 0, step: int = 1
) -> dict[int, Pruned]:
    """Remove heads `step` at a time, re-scoring the smaller model on `split` after each step (importance order) or
    drawing scores at random (`seed`); returns the model at each count of removed heads in `targets`."""
    if order not in ORDERS:
        raise PruneError(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")
    rng = random.Random(seed)
    kept = _original_indices(model)
    widths = [len(heads) + len(gone) for heads, gone in zip(kept, _removed_before(model), strict=True)]
    removed: list[tuple[int, int]] = []
    out, current = {}, model.eval()
    for target in sorted(set(targets)):
        while len(removed) < target:
            n = min(step, target - len(removed))
            if order == "importance":
                scores = normalise(gradient_importance(current, split))
            else:
                scores = [torch.tensor([rng.random() for _ in heads]) for heads in kept]
            chosen = _choose(scores, n)
            removed += [(i, kept[i][j]) for i, j in chosen]
            keep = [[j for j in range(len(heads)) if (i, j) not in chosen] for i, heads in enumerate(kept)]
            kept = [[heads[j] for j in k] for heads, k in zip(kept, keep, strict=True)]
            current = prune_model(current, keep)
            gone = tuple(tuple(sorted(set(range(w)) - set(k))) for w, k in zip(widths, kept, strict=True))
            current.config = replace(current.config, removed_heads=gone)
        out[target] = Pruned(current, target, tuple(tuple(k) for k in kept), tuple(removed))
    return out


def _removed_before(model: EncoderClassifier) -> list[tuple[int, ...]]:
    """Per layer, the original indices already pruned from `model` (none for a model that was never pruned)."""
    return list(model.config.removed_heads) or [() for _ in model.blocks]


def _original_indices(model: EncoderClassifier) -> list[list[int]]:
    """Per layer, the original indices of `model`'s heads, in order."""
    out = []
    for block, gone in zip(model.blocks, _removed_before(model), strict=True):
        width = block.attn.h + len(gone)
        out.append([j for j in range(width) if j not in gone])
    return out


def finetune(model: EncoderClassifier, split: Split, steps: int, lr: float, batch_size: int = 64, seed: int = 0):
    """`steps` AdamW steps at a constant `lr` on `split` (in place); the model is left in eval mode."""
    if steps < 1:
        return model.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order = batches(len(split.labels), batch_size, torch.Generator().manual_seed(seed))
    model.train()
    for _ in range(steps):
        ids, mask, labels = trimmed(split, next(order))
        loss = F.cross_entropy(model(ids, mask), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"fine-tuning loss became {float(loss)}; lower --finetune-lr")
    return model.eval()
