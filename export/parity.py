"""How to check an export: the parity gate, ONNX Runtime against torch on shapes that were not traced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from export.metadata import ATTENTION_MASK, INPUT_IDS, ModelMetadata
from export.tokenizer import NUM_SPECIAL


class ParityError(ValueError):
    """ONNX Runtime's outputs differ from torch's by more than the tolerance."""


def gate_shapes(max_len: int) -> list[tuple[int, int]]:
    """(batch, seq) pairs the gate runs: batch 1 and 7 by seq 1, 17 and max_len (none of them the traced (2, 8))."""
    seqs = sorted({1, min(17, max_len), max_len})
    return [(b, t) for b in (1, 7) for t in seqs]


def gate_inputs(meta: ModelMetadata, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with padding: in a batch of several rows, row i keeps seq - i tokens (at least 1)."""
    g = torch.Generator().manual_seed(seed + 1000 * batch + seq)
    low = NUM_SPECIAL if meta.vocab_size > NUM_SPECIAL else 0
    ids = torch.randint(low, meta.vocab_size, (batch, seq), generator=g, dtype=torch.int64)  # (B, T)
    mask = torch.ones(batch, seq, dtype=torch.int64)  # (B, T)
    for row in range(1, batch):
        keep = max(1, seq - row)
        mask[row, keep:] = 0
        ids[row, keep:] = 0
    return ids, mask


def check(module: nn.Module, onnx_path: Path, meta: ModelMetadata, atol: float = 1e-4) -> float:
    """Run every gate shape through torch and ORT (CPU); return the max abs difference or raise ParityError."""
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    worst = 0.0
    for batch, seq in gate_shapes(meta.max_len):
        ids, mask = gate_inputs(meta, batch, seq)
        with torch.no_grad():
            expected = module(ids, mask)
        expected = expected if isinstance(expected, tuple | list) else (expected,)
        got = session.run(output_names, {INPUT_IDS: ids.numpy(), ATTENTION_MASK: mask.numpy()})
        for name, ref, out in zip(output_names, expected, got, strict=True):
            ref = ref.detach().numpy()
            if ref.shape != out.shape:
                raise ParityError(f"{meta.name}: output {name!r} has shape {out.shape} in ORT, {ref.shape} in torch")
            diff = float(np.nanmax(np.abs(ref - out))) if ref.size else 0.0
            if not np.array_equal(np.isnan(ref), np.isnan(out)):
                diff = float("inf")
            worst = max(worst, diff)
            if diff > atol:
                raise ParityError(
                    f"{meta.name}: output {name!r} differs from torch by max abs {diff:.3g} > atol {atol:g} "
                    f"at batch={batch}, seq={seq}"
                )
    return worst
