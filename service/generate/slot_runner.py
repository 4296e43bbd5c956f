"""The step runner of a decoder whose cache is written in place (service/generate/slot_cache.py): executes one
Schedule (one decoding step for the running rows, then its prefill: prompts padded together, or the next chunk of a
long one) with the cache's rows bound as past and present, and samples each sequence's next token. The same contract
as StepRunner's (`execute`, `released`, `peak_bytes`, `reset`). Runs on the engine's thread only. No torch."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

from service.generate.plan import Chunk, Schedule
from service.generate.runner import cache_device, note_prompt, sample_next
from service.generate.sequence import Sequence
from service.generate.session import DecoderRuntime
from service.generate.settings import GenerationSettings
from service.generate.slot_cache import SlotCache, buffer_width


class SlotRunner:
    """Owns the rows: `_seqs[r]` is row r's sequence, the decoding ones first, then the prompt running in chunks (if
    any). After each `execute`, `released` holds the sequences whose rows (or prompts not run) it dropped, and
    `peak_bytes` what the cache holds."""

    def __init__(
        self,
        runtime: DecoderRuntime,
        settings: GenerationSettings,
    ) -> None:
        """Rows for `settings.max_running` sequences, on the session's device with `settings.io_binding` (None: on
        the GPU only), else in host memory."""
        self._session, self._pad_id = runtime.session, runtime.meta.pad_id
        self._logits = runtime.meta.output_names[0]
        device = slot_device(runtime, settings.io_binding)
        providers = runtime.session.get_providers()
        dtype = np.dtype(runtime.cache_dtype)
        self.cache = SlotCache(runtime.meta, dtype, slot_rows(runtime, settings, device), device, providers)
        self._seqs: list[Sequence] = []
        self._partial: Sequence | None = None  # a prompt part-run in chunks: the last row, its tokens so far cached
        self.released: list[Sequence] = []
        self.peak_bytes = 0

    @property
    def _decoding(self) -> int:
        return len(self._seqs) - (self._partial is not None)

    def execute(self, plan: Schedule) -> list[tuple[Sequence, int]]:
        """Every sequence of `plan.decode` with its next token, and those of `plan.prefill` whose context has run.
        Rows of neither left (cancelled, aborted, paused, preempted, or finished in the last step): each takes the
        last row's place at once."""
        self.released = []
        self._leave({seq.id for seq in plan.running})
        tokens = self._decode() if self._decoding else []
        if plan.chunk is not None:
            tokens += self._next_chunk(plan.chunk)
        elif plan.prefill:
            tokens += self._prefill(list(plan.prefilling))
        self.peak_bytes = self.cache.nbytes if self._seqs else 0
        return tokens

    def reset(self) -> None:
        """Forget the rows (after a failed run: the cache may be half-written)."""
        self.released = list(self._seqs)
        self.cache.clear()
        self._seqs, self._partial = [], None

    def _leave(self, staying: set[int]) -> None:
        """The decoding rows whose sequences left are filled by the last ones that stay, then the prompt in chunks
        moves up behind them; the rows past the end give their pages back."""
        decoding = self._decoding
        leaving = [r for r in range(decoding) if self._seqs[r].id not in staying]
        partial_leaves = self._partial is not None and self._partial.id not in staying
        if not leaving and not partial_leaves:
            return
        kept = decoding - len(leaving)
        holes = [r for r in leaving if r < kept]
        movers = [r for r in range(kept, decoding) if self._seqs[r].id in staying]
        self.released += [self._seqs[r] for r in leaving]
        for hole, row in zip(holes, movers, strict=True):
            self.cache.move(row, hole)
            self._seqs[hole] = self._seqs[row]
        seqs = self._seqs[:kept]
        if partial_leaves:
            self.released.append(self._partial)  # type: ignore[arg-type]
            self._partial = None
        elif self._partial is not None:
            if decoding != kept:
                self.cache.move(decoding, kept)
            seqs.append(self._partial)
        self.cache.truncate(len(seqs))
        self._seqs = seqs

    def _decode(self) -> list[tuple[Sequence, int]]:
        rows = self._decoding
        seqs = self._seqs[:rows]
        tokens = np.array([seq.next_input for seq in seqs], np.int64)  # (n,)
        logits = self._run(self.cache.decode_feeds(tokens), 0, rows)  # (n, 1, V)
        self.cache.advance(rows)
        return sample_next(seqs, logits[:, -1])

    def _prefill(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One run for whole prompts, padded together, into new rows at the end."""
        now = time.perf_counter()
        contexts = [seq.context for seq in seqs]  # a resumed sequence recomputes its tokens so far too
        for seq in seqs:
            seq.started = seq.started or now
        row = self.cache.add([len(c) for c in contexts])
        logits = self._run(SlotCache.prefill_feeds(contexts, self._pad_id), row, len(seqs))  # (n, P, V)
        self.cache.trim(row)
        self._seqs += seqs
        for at, (seq, context) in enumerate(zip(seqs, contexts, strict=True)):
            note_prompt(seq, logits[at, : len(context)], 0)
        last = np.array([len(c) - 1 for c in contexts])  # (n,): each prompt's last token, its column
        return sample_next(seqs, logits[np.arange(len(seqs)), last])

    def _next_chunk(self, chunk: Chunk) -> list[tuple[Sequence, int]]:
        """A chunk of a prompt, into its row (a new last one for its first) after the tokens run before; once its
        last has run, its row is a decoding one and it has its first token."""
        seq, done = chunk.seq, chunk.start
        if not done:
            seq.started = seq.started or time.perf_counter()
            self.cache.add([0])
            self._seqs.append(seq)
            self._partial = seq
        row = len(self._seqs) - 1
        ids = np.asarray(seq.context[done : done + chunk.count], np.int64)[None]  # (1, c)
        logits = self._run(SlotCache.chunk_feeds(ids, done), row, 1)  # (1, c, V)
        self.cache.grow(row, ids.shape[1])
        note_prompt(seq, logits[0], done)
        if not chunk.last:
            return []
        self._partial = None
        return sample_next([seq], logits[:, -1])

    def _run(self, feeds: dict[str, np.ndarray], first: int, rows: int) -> np.ndarray:
        return run_in_place(self._session, self._logits, self.cache, feeds, first, rows)


def slot_device(runtime: DecoderRuntime, io_binding: bool | None) -> str | None:
    """Where the slot buffers live: "cuda" when the session's device is bound, else host memory (None; the CPU's
    binding is the host's memory already)."""
    return "cuda" if cache_device(runtime, io_binding) == "cuda" else None


def slot_rows(runtime: DecoderRuntime, settings: GenerationSettings, device: str | None) -> int:
    """The buffer's rows: max_running, and on a device (whose buffer is allocated whole) no more than the KV budget
    holds rows of the whole context."""
    if device is None:
        return settings.max_running
    dtype = np.dtype(runtime.cache_dtype)
    width = buffer_width(runtime.meta, dtype)
    return min(settings.max_running, settings.kv_budget_tokens(runtime.meta, dtype.itemsize, width) // width)


def run_in_place(
    session: ort.InferenceSession, logits: str, cache: SlotCache, feeds: dict[str, np.ndarray], first: int, rows: int
) -> np.ndarray:
    """One run over the cache's rows [first, first + rows): the logits, on the host."""
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output(logits, "cpu")  # first: get_outputs() follows the binding's order
    cache.bind(binding, first, rows)
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()
