"""How to check a decoder export: the generation parity gate. Greedy generation through ONNX Runtime with the KV cache
against torch without a cache (the whole sequence again at every step), on prompts that were not traced: one prompt
alone and a batch of unequal prompts (left-padded, or left-aligned where the graph writes its cache in place)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from contract.decoder_metadata import POSITION_IDS, DecoderMetadata
from contract.metadata import ATTENTION_MASK, INPUT_IDS, LOGITS
from contract.tokenizer import NUM_SPECIAL
from export.decoder import DecoderLM, positions_from_mask
from export.parity import ParityError

DEFAULT_ATOL = 1e-4  # max abs difference of any logit, prefill and every step (the classifiers' gate uses the same)
NEW_TOKENS = 32  # greedy tokens generated per prompt
SINGLE_PROMPT = 5  # a batch of one prompt of 5 tokens (the trace was 2 x 8 new tokens over 4 cached)
BATCH_PROMPTS = (3, 9, 14)  # a batch of unequal prompts, left-padded to the longest
MIN_CONTEXT = NEW_TOKENS + max(SINGLE_PROMPT, 2)  # the shortest context length the gate can run in


class GenerationParityError(ParityError):
    """ONNX Runtime's generation differs from torch's: a logit beyond the bound, or a different greedy token."""


class ContextTooShortError(ValueError):
    """The model's context length cannot hold the gate's prompts and generated tokens."""


@dataclass(frozen=True)
class GateReport:
    max_diff: float  # the largest abs logit difference, prefill and steps, every case
    atol: float
    tokens: int  # greedy tokens compared, all cases and rows
    near_ties: int  # tokens where ORT chose the other of two logits closer than 2 x atol (allowed)

    def to_json(self) -> dict[str, object]:
        return {
            "max_diff": self.max_diff,
            "atol": self.atol,
            "tokens": self.tokens,
            "near_ties": self.near_ties,
            "new_tokens": NEW_TOKENS,
        }


def check_context(meta: DecoderMetadata) -> None:
    if meta.max_len < MIN_CONTEXT:
        raise ContextTooShortError(
            f"max_len={meta.max_len} (the context length) is below {MIN_CONTEXT}, what the generation parity gate "
            f"needs: a {SINGLE_PROMPT}-token prompt and {NEW_TOKENS} generated tokens"
        )


def gate_prompts(meta: DecoderMetadata, seed: int = 0) -> list[list[list[int]]]:
    """The gate's cases: one prompt alone, then a batch of unequal prompts (lengths capped to fit the context)."""
    g = torch.Generator().manual_seed(seed)
    room = meta.max_len - NEW_TOKENS
    low = NUM_SPECIAL if meta.vocab_size > NUM_SPECIAL else 0

    def prompt(n: int) -> list[int]:
        return [meta.bos_id, *torch.randint(low, meta.vocab_size, (min(n, room) - 1,), generator=g).tolist()]

    lengths = sorted({min(n, room) for n in BATCH_PROMPTS})
    return [[prompt(SINGLE_PROMPT)], [prompt(n) for n in lengths]]


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask (B, T) of prompts padded on the left to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.int64)  # (B, T)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.int64)  # (B, T)
    return ids, mask


def check(model: DecoderLM, onnx_path: Path, meta: DecoderMetadata, atol: float = DEFAULT_ATOL) -> GateReport:
    """Run every case; the report, or GenerationParityError with the measured difference."""
    check_context(meta)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    gate = _Gate(model.eval(), session, meta, atol)
    for case, prompts in zip(("one prompt", "left-padded batch"), gate_prompts(meta), strict=True):
        gate.run_case(case, prompts)
    return GateReport(gate.worst, atol, gate.tokens, gate.near_ties)


class _Gate:
    def __init__(self, model: DecoderLM, session: ort.InferenceSession, meta: DecoderMetadata, atol: float) -> None:
        self.model, self.session, self.meta, self.atol = model, session, meta, atol
        self.worst, self.tokens, self.near_ties = 0.0, 0, 0

    def run_case(self, case: str, prompts: list[list[int]]) -> None:
        """Greedy, in lockstep: each step's token is torch's, fed to both; ORT's own choice is checked against it.
        ORT gets the batch in its graph's layout (left-padded, or left-aligned for a cache written in place)."""
        meta = self.meta
        ids, mask = left_padded(prompts, meta.pad_id)  # (B, T0), torch's batch
        B = ids.shape[0]
        where = f"{case} (batch {B}, prompts of {', '.join(str(len(p)) for p in prompts)} tokens)"
        empty = np.zeros((B, meta.kv_heads, 0, meta.head_dim), np.float32)
        past = {name: empty for name in meta.input_names[3:]}
        lengths = np.array([len(p) for p in prompts])  # (B,) tokens so far per row
        feeds = self._prefill_feeds(ids.numpy(), mask.numpy(), lengths)
        for step in range(NEW_TOKENS):
            got = self._run({**feeds, **past}, where, step, feeds[ATTENTION_MASK].shape[1])
            expected = self._torch(ids, mask, where, step)  # (B, T, V): the whole sequence, no cache
            if step == 0:  # prefill: every position that holds a token, in token order in both layouts
                ours = got[LOGITS][feeds[ATTENTION_MASK].astype(bool)]  # (tokens, V)
                self._compare(ours, expected[mask.numpy().astype(bool)], where, "prefill")
                last = got[LOGITS][np.arange(B), self._last_column(feeds[ATTENTION_MASK], lengths)]  # (B, V)
            else:
                last = got[LOGITS][:, -1]  # (B, V)
                self._compare(last, expected[:, -1], where, f"step {step}")
            token = self._choose(last, expected[:, -1], where, step)  # (B,)
            ids = torch.cat([ids, token[:, None]], dim=1)  # (B, T+1)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.int64)], dim=1)  # (B, T+1)
            past = {name: got[name.replace("past_key_values", "present")] for name in past}
            feeds = self._step_feeds(token.numpy(), mask.numpy(), lengths)
            lengths = lengths + 1

    def _prefill_feeds(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """The prompts (B, T) as torch has them (left-padded), in the graph's layout."""
        if not self.meta.cache_in_place:
            return {
                INPUT_IDS: ids,
                ATTENTION_MASK: mask,
                POSITION_IDS: positions_from_mask(torch.from_numpy(mask)).numpy(),
            }
        width = ids.shape[1]
        ours = np.full_like(ids, self.meta.pad_id)  # (B, T): each row's tokens from column 0
        for row, n in enumerate(lengths):
            ours[row, :n] = ids[row, width - n :]
        left = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)  # (B, T): ones first
        return {INPUT_IDS: ours, ATTENTION_MASK: left, POSITION_IDS: np.tile(np.arange(width), (len(ids), 1))}

    def _step_feeds(self, token: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """One new token (B,) per row after `lengths` (B,) cached tokens: torch's mask (B, T+1) left-padded."""
        if self.meta.cache_in_place:
            width = int(lengths.max()) + 1
            mask = (np.arange(width)[None, :] <= lengths[:, None]).astype(np.int64)  # (B, W): ones first
        return {INPUT_IDS: token[:, None], ATTENTION_MASK: mask, POSITION_IDS: lengths[:, None].astype(np.int64)}

    def _last_column(self, mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Each row's last prompt token's column in the graph's layout (B,)."""
        return lengths - 1 if self.meta.cache_in_place else np.full(len(lengths), mask.shape[1] - 1)

    def _run(self, feeds: dict[str, np.ndarray], where: str, step: int, total: int) -> dict[str, np.ndarray]:
        names = self.meta.output_names
        try:
            outputs = dict(zip(names, self.session.run(names, feeds), strict=True))
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GenerationParityError(
                f"{self.meta.name}: ONNX Runtime failed on {where}, step {step}: {first}"
            ) from exc
        B = feeds[INPUT_IDS].shape[0]
        want = (B, self.meta.kv_heads, total, self.meta.head_dim)
        for name in names[1:]:
            if outputs[name].shape != want:
                raise GenerationParityError(
                    f"{self.meta.name}: {name} has shape {outputs[name].shape} on {where}, step {step}; want {want}"
                )
        return outputs

    def _torch(self, ids: torch.Tensor, mask: torch.Tensor, where: str, step: int) -> np.ndarray:
        try:
            with torch.no_grad():
                logits, _ = self.model(ids, mask, positions_from_mask(mask))  # (B, T, V)
        except Exception as exc:
            raise GenerationParityError(
                f"{self.meta.name}: the torch model failed on {where}, step {step}: {exc}"
            ) from exc
        return logits.numpy()

    def _compare(self, got: np.ndarray, expected: np.ndarray, where: str, what: str) -> None:
        """Max abs difference of the logits (..., V) of the same tokens."""
        if got.shape != expected.shape:
            raise GenerationParityError(
                f"{self.meta.name}: {LOGITS} has shape {got.shape} in ORT, {expected.shape} in torch ({where}, {what})"
            )
        diff = float(np.max(np.abs(got - expected))) if np.isfinite(got).all() else float("inf")
        self.worst = max(self.worst, diff)
        if diff > self.atol:
            raise GenerationParityError(
                f"{self.meta.name}: {LOGITS} differ from torch by max abs {diff:.3g} > atol {self.atol:g} "
                f"({where}, {what})"
            )

    def _choose(self, got: np.ndarray, expected: np.ndarray, where: str, step: int) -> torch.Tensor:
        """torch's greedy tokens (B,); ORT's must be the same, or within a near tie (top two closer than 2 atol)."""
        theirs, ours = expected.argmax(axis=-1), got.argmax(axis=-1)  # (B,)
        for row in np.flatnonzero(theirs != ours):
            gap = float(expected[row, theirs[row]] - expected[row, ours[row]])
            if gap > 2 * self.atol:
                raise GenerationParityError(
                    f"{self.meta.name}: greedy token {step + 1} of row {row} differs ({where}): ONNX Runtime chose "
                    f"{ours[row]}, torch {theirs[row]}, whose logits are {gap:.3g} apart (> 2 x atol {self.atol:g})"
                )
            self.near_ties += 1
        self.tokens += len(theirs)
        return torch.from_numpy(theirs).to(torch.int64)
