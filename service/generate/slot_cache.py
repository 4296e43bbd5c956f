"""The KV cache written in place, for a graph whose attention reads each row's own length (its metadata's
`cache_in_place`: ORT's GroupQueryAttention). Per layer, keys and values live in one buffer of `rows` x the whole
context, (rows, kv_heads, width, head_dim); a running sequence owns a row, its tokens from column 0. A step binds the
rows it runs as both `past` and `present` (ORT I/O binding), so the graph writes the new tokens after each row's own
and nothing is copied from step to step, nor when sequences join. The only module that knows that layout. No torch.

Rows stay dense: the decoding rows first, then at most one prompt part-run in chunks. A row that leaves takes the last
one's place (one row's tokens copied); new rows are added at the end.

What it holds: on the CPU the buffers are anonymous mappings whose pages exist once written, and a row's pages past
its end are given back (madvise) when it leaves or after a padded prefill, so a row of n tokens holds each head's
first `ceil(n / page_tokens)` pages: the scheduler charges each sequence its final length rounded up to `page_tokens`
(its bytes exactly, when a head's token divides a page). On a GPU a buffer is allocated whole: a row costs the whole
width."""

from __future__ import annotations

import math
import mmap

import numpy as np
import onnxruntime as ort

from contract.decoder_metadata import POSITION_IDS, DecoderMetadata
from contract.metadata import ATTENTION_MASK, INPUT_IDS
from service.generate.kv_cache import token_bytes
from service.generate.row_copy import RowCopy

PAGE = mmap.PAGESIZE


def page_tokens(meta: DecoderMetadata, dtype: np.dtype) -> int:
    """The fewest tokens whose keys (one head's) fill whole pages: a row's pages grow by this many tokens at a time."""
    head_token = meta.head_dim * np.dtype(dtype).itemsize
    return PAGE // math.gcd(PAGE, head_token)


def buffer_width(meta: DecoderMetadata, dtype: np.dtype) -> int:
    """The context rounded up to whole pages per head, so that every head's part of a row starts on a page."""
    block = page_tokens(meta, dtype)
    return -(-meta.max_len // block) * block


def charge(tokens: int, block: int) -> int:
    """`tokens` rounded up to whole blocks: what a row of them holds."""
    return -(-tokens // block) * block


class SlotCache:
    """`rows` rows of the whole context; `device` "cuda" keeps the buffers on the GPU (else host memory)."""

    def __init__(
        self,
        meta: DecoderMetadata,
        dtype: np.dtype,
        rows: int,
        device: str | None = None,
        providers: list | None = None,
    ) -> None:
        """`providers`: the session's, for the device's row copies."""
        self.past_names = meta.input_names[3:]  # past_key_values.{i}.key|value, in the graph's order
        self.present_names = meta.output_names[1:]
        self.capacity, self._dtype, self.device = rows, np.dtype(dtype), device
        self.width = buffer_width(meta, dtype)
        # what a row is charged in: whole pages per head on the CPU, the whole width on a GPU
        self.block = page_tokens(meta, dtype) if device is None else self.width
        self._shape = (meta.kv_heads, self.width, meta.head_dim)  # one row
        self._row_bytes = int(np.prod(self._shape)) * self._dtype.itemsize
        self._head_bytes = self.width * meta.head_dim * self._dtype.itemsize  # page-aligned: width is whole pages
        self.token_bytes = token_bytes(meta, self._dtype)
        self.lengths = np.zeros(0, np.int64)  # (n,) tokens cached per row in use
        if device is None:
            # private: a page given back is freed (a shared mapping would keep it and map it back on the next read)
            self._maps = [mmap.mmap(-1, rows * self._row_bytes, flags=mmap.MAP_PRIVATE) for _ in self.past_names]
            self._host = [np.frombuffer(m, self._dtype).reshape(rows, *self._shape) for m in self._maps]
            self._pointers = [a.ctypes.data for a in self._host]
        else:
            shape = [rows, *self._shape]
            self._device = [
                ort.OrtValue.ortvalue_from_shape_and_type(shape, self._dtype, device, 0) for _ in self.past_names
            ]
            self._pointers = [v.data_ptr() for v in self._device]
            self._copy = RowCopy(self._dtype, device, providers or [])

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def nbytes(self) -> int:
        """What the rows in use hold: on the CPU their pages (each head's tokens rounded up to pages), on a GPU the
        whole buffer."""
        if self.device is not None:
            return self.capacity * self._row_bytes * len(self.past_names)
        return int(sum(self.charge(int(n)) for n in self.lengths)) * self.token_bytes

    def charge(self, tokens: int) -> int:
        """The tokens a row of `tokens` is charged for (whole blocks)."""
        return charge(tokens, self.block)

    def bind(self, binding: ort.IOBinding, first: int, count: int) -> None:
        """Rows [first, first + count) as both past and present of every layer."""
        shape = [count, *self._shape]
        where = "cpu" if self.device is None else self.device
        for past, present, pointer in zip(self.past_names, self.present_names, self._pointers, strict=True):
            at = pointer + first * self._row_bytes
            binding.bind_input(past, where, 0, self._dtype, shape, at)
            binding.bind_output(present, where, 0, self._dtype, shape, at)

    def decode_feeds(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """(n,) each row's next input token -> the decoding step's feeds for rows [0, n): the token at position
        lengths[row], the mask's ones its tokens and the new one."""
        lengths = self.lengths[: tokens.size]
        mask = (np.arange(int(lengths.max()) + 1)[None, :] <= lengths[:, None]).astype(np.int64)  # (n, W + 1)
        return {INPUT_IDS: tokens[:, None], ATTENTION_MASK: mask, POSITION_IDS: lengths[:, None].copy()}

    @staticmethod
    def prefill_feeds(contexts: list[tuple[int, ...]], pad_id: int) -> dict[str, np.ndarray]:
        """Whole prompts, each from column 0 and padded on the right to the longest (n, P); the graph writes each into
        its row from column 0, padding included (`trim` gives back what lies past a row's end)."""
        width = max(len(c) for c in contexts)
        ids = np.full((len(contexts), width), pad_id, np.int64)  # (n, P)
        for row, context in enumerate(contexts):
            ids[row, : len(context)] = context
        lengths = np.array([len(c) for c in contexts], np.int64)  # (n,)
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)  # (n, P): ones first
        return {
            INPUT_IDS: ids,
            ATTENTION_MASK: mask,
            POSITION_IDS: np.tile(np.arange(width, dtype=np.int64), (len(ids), 1)),
        }

    @staticmethod
    def chunk_feeds(ids: np.ndarray, done: int) -> dict[str, np.ndarray]:
        """The next part (1, c) of one prompt after `done` of its tokens: the mask covers both."""
        end = done + ids.shape[1]
        return {INPUT_IDS: ids, ATTENTION_MASK: np.ones((1, end), np.int64), POSITION_IDS: np.arange(done, end)[None]}

    def add(self, lengths: list[int]) -> int:
        """New rows at the end, holding `lengths` tokens once their prefill has run; their first row."""
        first = self.rows
        if first + len(lengths) > self.capacity:
            raise RuntimeError(f"the KV cache has {self.capacity} rows: {first} in use, {len(lengths)} more asked")
        self.lengths = np.concatenate([self.lengths, np.asarray(lengths, np.int64)])
        return first

    def advance(self, rows: int, by: int = 1) -> None:
        """After a step: the first `rows` rows hold `by` more tokens each."""
        self.lengths[:rows] += by

    def grow(self, row: int, by: int) -> None:
        self.lengths[row] += by

    def move(self, source: int, target: int) -> None:
        """Row `source`'s tokens into row `target` (whose sequence left)."""
        n = int(self.lengths[source])
        if self.device is None:
            for buffer in self._host:
                buffer[target, :, :n] = buffer[source, :, :n]  # (kv, n, hs)
        else:  # the whole row: the device's buffer is allocated whole anyway
            for pointer in self._pointers:
                count = self._row_bytes // self._dtype.itemsize
                self._copy.copy(pointer + source * self._row_bytes, pointer + target * self._row_bytes, count)
        self.lengths[target] = n

    def truncate(self, rows: int) -> None:
        """Only the first `rows` rows stay; the pages of the others are given back."""
        for row in range(rows, self.rows):
            self._release(row, 0)
        self.lengths = self.lengths[:rows].copy()

    def trim(self, first: int) -> None:
        """Give back the pages of rows [first, ...) past their own tokens (a padded prefill wrote there)."""
        for row in range(first, self.rows):
            self._release(row, self.charge(int(self.lengths[row])))

    def clear(self) -> None:
        self.truncate(0)

    def _release(self, row: int, keep: int) -> None:
        """Each head's part of `row` past its first `keep` tokens goes back to the system (reads as zeros)."""
        if self.device is not None:
            return
        kept = keep * self._head_bytes // self.width  # page-aligned: keep is whole pages
        if kept >= self._head_bytes:
            return
        for buffer in self._maps:
            for head in range(self._shape[0]):
                start = row * self._row_bytes + head * self._head_bytes
                buffer.madvise(mmap.MADV_DONTNEED, start + kept, self._head_bytes - kept)
