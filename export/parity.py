"""How to check an export: the parity gate, ONNX Runtime against torch on shapes that were not traced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from contract.metadata import ATTENTION_MASK, ATTENTION_WEIGHTS, INPUT_IDS, LOGITS, ModelMetadata
from contract.tokenizer import NUM_SPECIAL


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
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the gate's output stays readable
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    worst = 0.0
    for batch, seq in gate_shapes(meta.max_len):
        ids, mask = gate_inputs(meta, batch, seq)
        try:
            with torch.no_grad():
                expected = module(ids, mask)
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
            raise ParityError(
                f"{meta.name}: the torch model failed at batch={batch}, seq={seq}: {type(exc).__name__}: {detail}"
            ) from exc
        expected = tuple(expected) if isinstance(expected, tuple | list) else (expected,)
        if len(expected) != len(output_names):
            raise ParityError(f"{meta.name}: torch returns {len(expected)} outputs, the ONNX file {output_names}")
        got = session.run(output_names, {INPUT_IDS: ids.numpy(), ATTENTION_MASK: mask.numpy()})
        for name, ref, out in zip(output_names, expected, got, strict=True):
            diff = _compare(meta, name, ref, out, batch, seq)
            worst = max(worst, diff)
            if diff > atol:
                raise ParityError(
                    f"{meta.name}: output {name!r} differs from torch by max abs {diff:.3g} > atol {atol:g} "
                    f"at batch={batch}, seq={seq}"
                )
    return worst


def expected_shape(meta: ModelMetadata, name: str, batch: int, seq: int) -> tuple[int, ...] | None:
    """The contract's shape for an output (architecture.md); None for an output the contract does not fix."""
    if name == LOGITS:
        return (batch, meta.num_classes)
    if name == ATTENTION_WEIGHTS:
        return (batch, meta.layers, meta.heads, seq, seq)
    return None


def _compare(meta: ModelMetadata, name: str, ref: torch.Tensor, out: np.ndarray, batch: int, seq: int) -> float:
    """Max abs difference of one output, after checking that both follow the contract (shape, float32, finite)."""
    if not isinstance(ref, torch.Tensor):
        raise ParityError(f"{meta.name}: output {name!r} is a {type(ref).__name__} in torch, not a tensor")
    ref = ref.detach().cpu().numpy()
    want = expected_shape(meta, name, batch, seq)
    if want is not None and ref.shape != want:
        raise ParityError(
            f"{meta.name}: output {name!r} has shape {ref.shape} at batch={batch}, seq={seq}; the contract wants {want}"
        )
    if ref.dtype != np.float32 or out.dtype != np.float32:
        raise ParityError(f"{meta.name}: output {name!r} is {ref.dtype} in torch and {out.dtype} in ORT, not float32")
    if ref.shape != out.shape:
        raise ParityError(f"{meta.name}: output {name!r} has shape {out.shape} in ORT, {ref.shape} in torch")
    if not np.isfinite(ref).all():
        raise ParityError(f"{meta.name}: torch output {name!r} holds NaN or inf at batch={batch}, seq={seq}")
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.max(np.abs(ref - out))) if ref.size else 0.0
