"""How far a model's answers are from its fp32 source's on the same inputs: accuracy, the accuracy drop in points with
a paired bootstrap confidence interval (examples resampled, both models' answers kept together), and argmax
agreement. Torch-free: numpy over logits from ONNX Runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
DECIMALS = 6  # of points: far below one example in a million, and no float noise (1.0000000000000009) in the JSON
_CHUNK = 100  # resamples drawn at once: (chunk, N) indices in memory


@dataclass(frozen=True)
class AccuracyDrop:
    agreement: float  # fraction of inputs whose argmax equals the source's
    accuracy: float | None  # fraction correct; None without labels
    drop_points: float | None  # source accuracy - this accuracy, in points (percent)
    ci_points: tuple[float, float] | None  # CONFIDENCE interval of drop_points


def bootstrap_ci(source_correct: np.ndarray, correct: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """The CONFIDENCE percentile interval, in points, of the accuracy drop over `resamples` paired resamples of the
    examples (the same examples for both models in each resample, so their shared difficulty cancels)."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    diff = (source_correct.astype(np.float64) - correct.astype(np.float64)) * 100  # (N,): -100, 0 or 100
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, resamples, _CHUNK):
        rows = rng.integers(0, len(diff), (min(_CHUNK, resamples - start), len(diff)))  # (b, N) example indices
        means.append(diff[rows].mean(axis=1))  # (b,)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(np.concatenate(means), [tail, 100 - tail])
    return round(float(lo), DECIMALS), round(float(hi), DECIMALS)


def accuracy_drop(
    source: np.ndarray, logits: np.ndarray, labels: np.ndarray | None, resamples: int, seed: int
) -> AccuracyDrop:
    """`logits` (N, C) against the source's (N, C) on the same inputs; with labels (N,), accuracy and the drop too."""
    if source.shape != logits.shape:
        raise ValueError(f"logits of shape {logits.shape} against the source's {source.shape}")
    agreement = float(np.mean(source.argmax(axis=1) == logits.argmax(axis=1)))
    if labels is None:
        return AccuracyDrop(agreement, None, None, None)
    source_correct, correct = source.argmax(axis=1) == labels, logits.argmax(axis=1) == labels  # (N,) each
    drop = round(float(source_correct.mean() - correct.mean()) * 100, DECIMALS)
    ci = bootstrap_ci(source_correct, correct, resamples, seed)
    return AccuracyDrop(agreement, float(correct.mean()), drop, ci)
