"""Dynamic batching arithmetic: merge several requests' rows into one batch padded to its longest sequence, split back.

Pure numpy so it is unit-testable without Ray. No torch.
"""

from __future__ import annotations

import numpy as np

from export.tokenizer import PAD_ID


def effective_length(mask: np.ndarray) -> int:
    """Columns up to the last one where any row has a real token (trailing all-padding columns are dropped)."""
    used = np.flatnonzero(mask.any(axis=0))  # (T,) -> indices of columns with a token
    return int(used[-1]) + 1 if used.size else 1


def merge(requests: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(ids, mask) pairs of shapes (n_i, T_i) -> one (sum n_i, max T) pair and the row count of each request."""
    lengths = [effective_length(mask) for _, mask in requests]
    width = max(lengths)
    rows = [ids.shape[0] for ids, _ in requests]
    ids_out = np.full((sum(rows), width), PAD_ID, dtype=np.int64)  # (N, T)
    mask_out = np.zeros((sum(rows), width), dtype=np.int64)  # (N, T)
    start = 0
    for (ids, mask), n, t in zip(requests, rows, lengths, strict=True):
        ids_out[start : start + n, :t] = ids[:, :t]
        mask_out[start : start + n, :t] = mask[:, :t]
        start += n
    return ids_out, mask_out, rows


def split(logits: np.ndarray, rows: list[int]) -> list[np.ndarray]:
    """(N, C) logits -> one (n_i, C) array per request, in order."""
    if logits.shape[0] != sum(rows):
        raise ValueError(f"logits have {logits.shape[0]} rows, the batch had {sum(rows)}")
    return np.split(logits, np.cumsum(rows)[:-1])
