"""The running batch's KV cache: per layer, past keys and values of shape (B, kv_heads, W, head_dim), each sequence in
its own row, right-aligned (its cached tokens are the row's last `lengths[row]` columns; the columns before them are
padding, masked out). The only module that knows that layout: a graph whose attention is ONNX's `Attention` (it reads
a buffer's whole capacity, so one written in place measured no faster: `benchmarks.kv_layout`); a graph that reads
each row's own length has its cache written in place instead (slot_cache.py). No torch.

Where the copies are (each a full copy of every layer's cache):
  1. every decoding step: the graph concatenates past and the new token into `present` (inside ONNX Runtime);
  2. `join`: the running rows that stay and the new ones copied into arrays one prefill wider or taller;
  3. `keep`: rows that leave dropped and all-padding leading columns trimmed, in one copy. The step runner calls it
     when many rows have left and none join, or when a row that left would widen the batch past its charge.
With a `device` (ORT I/O binding, for the GPU) the past stays there as OrtValues between decoding steps; `join` and
`keep`, which happen when sequences arrive or leave, go through the host.

What the layout holds, and so what the scheduler charges (docs/serving.md, "The KV budget"): a batch of `rows` rows
is never wider than `charged_width` of their final lengths, and a step holds at most COPIES such rectangles (copy 1's
past and present, or a join's old and merged arrays), so its bytes are at most
COPIES x rows x charged_width x bytes per token.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from contract.decoder_metadata import POSITION_IDS, DecoderMetadata
from contract.metadata import ATTENTION_MASK, INPUT_IDS

Past = list[np.ndarray] | list[ort.OrtValue]  # per layer, key then value: (B, kv_heads, W, head_dim)
COPIES = 2  # rectangles a step holds at once: a decoding step's past and present, a join's old and merged arrays
# Steps a row that left may ride along, unused, past the width its batch was charged for before a copy drops it: a
# join (which drops it anyway) usually comes first, and a copy at every leave cost 9 % of the engine's thread.
LEAVE_SLACK = 16


def charged_width(finals: list[int], max_len: int) -> int:
    """The widest the batch may grow, for rows whose sequences end at `finals` tokens (prompt + max_tokens) each:
    the longest, plus LEAVE_SLACK for rows that left, within the context."""
    return min(max(finals, default=0) + LEAVE_SLACK, max_len)


def token_bytes(meta: DecoderMetadata, dtype: np.dtype) -> int:
    """One cached token of one row: key and value, every layer, in the cache's dtype (fp16 halves it)."""
    return 2 * meta.layers * meta.kv_heads * meta.head_dim * np.dtype(dtype).itemsize


def nbytes(past: Past | dict) -> int:
    """The bytes of a past (a list of arrays or OrtValues, or feeds by name)."""
    values = past.values() if isinstance(past, dict) else past
    return sum(int(v.tensor_size_in_bytes()) if isinstance(v, ort.OrtValue) else v.nbytes for v in values)


class BatchCache:
    """Rows in the order of `BatchCache.rows`' caller (the step runner keeps which sequence is in which row).
    `device` ("cuda", or "cpu" to run the same path on the host): the past is kept as OrtValues there."""

    def __init__(self, meta: DecoderMetadata, dtype: np.dtype, device: str | None = None) -> None:
        self.past_names = meta.input_names[3:]  # past_key_values.{i}.key|value, in the graph's order
        self._shape, self._dtype, self.device = (meta.kv_heads, meta.head_dim), dtype, device
        self.lengths = np.zeros(0, np.int64)  # (B,) tokens cached per row
        self.width = 0  # W
        self.past: Past = self._empty(0, 0)

    @property
    def nbytes(self) -> int:
        return nbytes(self.past)

    def _empty_host(self, rows: int, width: int) -> list[np.ndarray]:
        kv, hd = self._shape
        return [np.zeros((rows, kv, width, hd), self._dtype) for _ in self.past_names]  # (B, kv, W, hs) each

    def _empty(self, rows: int, width: int) -> Past:
        empty = self._empty_host(rows, width)
        return empty if self.device is None else [self._to_device(p) for p in empty]

    def empty_feeds(self, rows: int) -> dict[str, np.ndarray]:
        """An empty past (W = 0) for a prefill of `rows` new sequences."""
        return dict(zip(self.past_names, self._empty_host(rows, 0), strict=True))  # no bytes to place anywhere

    def decode_feeds(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """(B,) each row's next input token -> the decoding step's feeds: the token at position lengths[row]."""
        width = self.width
        first = (width - self.lengths)[:, None]  # (B, 1): each row's first real column
        mask = (np.arange(width + 1)[None, :] >= first).astype(np.int64)  # (B, W + 1): 0 on the left padding
        return {
            INPUT_IDS: tokens[:, None],  # (B, 1)
            ATTENTION_MASK: mask,
            POSITION_IDS: self.lengths[:, None].copy(),  # (B, 1): positions count from each row's own first token
            **dict(zip(self.past_names, self.past, strict=True)),
        }

    def advance(self, present: Past) -> None:
        """After a decoding step: `present` (B, kv, W + 1, hs) per layer is the next past (copy 1 made it; on the
        device when it has one)."""
        self.past = present
        self.width += 1
        self.lengths = self.lengths + 1

    def join(self, present: Past, lengths: np.ndarray, kept: list[int] | None = None) -> None:
        """New rows after the running ones: a prefill's `present` (n, kv, P, hs) per layer, left-padded, with `lengths`
        (n,) real tokens per row; `kept`: the running rows that stay, in this order (None: all). Copy 2: the rows
        that stay and the new ones into arrays as wide as the longest of them needs (rows that left cost no copy of
        their own: they go in this one)."""
        kept = list(range(self.lengths.size)) if kept is None else kept
        old_lengths = self.lengths[kept]
        width = int(old_lengths.max()) if old_lengths.size else 0
        start = self.width - width  # leading columns that are padding in every row that stays
        present = self._host(present)
        new_width = max(width, present[0].shape[2])
        kv, hs = self._shape
        # Uninitialized, then the padding zeroed: a zeroed allocation would write every byte once more, and the
        # padding must hold zeros, not whatever was there (a NaN times a masked-out weight of 0 is still NaN).
        merged = [np.empty((len(kept) + len(lengths), kv, new_width, hs), self._dtype) for _ in self.past_names]
        runs = _runs(kept)
        for out, old, new in zip(merged, self._host(self.past), present, strict=True):
            kept_part, new_part = out[: len(kept)], out[len(kept) :]  # (B', kv, W', hs), (n, kv, W', hs)
            kept_part[:, :, : new_width - width] = 0
            for at, first, count in runs:  # runs of consecutive rows: one copy each, no gathered temporary
                kept_part[at : at + count, :, new_width - width :] = old[first : first + count, :, start:]
            new_part[:, :, : new_width - new.shape[2]] = 0
            new_part[:, :, new_width - new.shape[2] :] = new  # (n, kv, P, hs) right-aligned likewise
        self._set(merged, np.concatenate([old_lengths, lengths.astype(np.int64)]))

    def keep(self, rows: list[int]) -> None:
        """Only these rows stay, in this order; leading columns that are padding in every one left are trimmed.
        Copy 3 (none when every row stays)."""
        if rows == list(range(self.lengths.size)):
            return
        lengths = self.lengths[rows]
        width = int(lengths.max()) if lengths.size else 0
        start = self.width - width
        index = np.asarray(rows, np.int64)
        self._set([p[index, :, start:, :] for p in self._host(self.past)], lengths)  # (B', kv, W', hs): one gather

    def clear(self) -> None:
        self._set(self._empty_host(0, 0), np.zeros(0, np.int64))

    def _set(self, past: list[np.ndarray], lengths: np.ndarray) -> None:
        self.past = past if self.device is None else [self._to_device(p) for p in past]
        self.width, self.lengths = past[0].shape[2], lengths

    def _host(self, past: Past) -> list[np.ndarray]:
        return [p.numpy() if isinstance(p, ort.OrtValue) else p for p in past]

    def _to_device(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, 0)


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """`rows` as runs of consecutive indices: (position in `rows`, first row, count)."""
    runs: list[tuple[int, int, int]] = []
    for at, row in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, row, 1))
    return runs
