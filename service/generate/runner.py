"""The step runner of a decoder whose graph concatenates its cache: executes one Schedule on the decoder's ORT session
(one batched decoding step for the running rows, then its prefill: prompts left-padded together, or the next chunk
of a long one, which joins the batch once its whole prompt has run) and samples each sequence's next token; the
sampling and the prompt's logprobs are both runners'. Runs on the engine's thread only. No torch."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import onnxruntime as ort

from contract.decoder_metadata import POSITION_IDS
from contract.metadata import ATTENTION_MASK, INPUT_IDS
from service.generate.kv_cache import BatchCache, Past, charged_width, nbytes
from service.generate.plan import Chunk, Schedule
from service.generate.sampling import logprobs_of, sample
from service.generate.sequence import Sequence
from service.generate.session import DecoderRuntime


class StepRunner:
    """Owns the batch: which sequence is in which row of the KV cache. After each `execute`, `released` holds the
    sequences whose rows (or prompts not run) it dropped, and `peak_bytes` what the cache held at the step's peak
    (0 when it holds nothing after it)."""

    def __init__(self, runtime: DecoderRuntime, io_binding: bool | None = None) -> None:
        """`io_binding` (None: on the GPU only): the KV cache stays where the session runs between steps."""
        self._session, self._pad_id = runtime.session, runtime.meta.pad_id
        self._outputs = runtime.meta.output_names  # logits, then present.{i}.key|value
        self._cache = BatchCache(runtime.meta, np.dtype(runtime.cache_dtype), cache_device(runtime, io_binding))
        self._rows: list[Sequence | None] = []  # by row of the cache; None: a row whose sequence left
        self._owners: list[Sequence] = []  # by row: whose row it is, left or not (what the scheduler charges)
        self._max_len = runtime.meta.max_len
        self._partial: tuple[Sequence, dict] | None = None  # a prompt part-run in chunks, and its past (1, kv, n, hs)
        self.released: list[Sequence] = []
        self.peak_bytes = 0

    def execute(self, plan: Schedule) -> list[tuple[Sequence, int]]:
        """Every sequence of `plan.decode` with its next token, and those of `plan.prefill` whose context has run.
        Rows of neither left (cancelled, aborted, paused, preempted, or finished in the last step): they stay in the
        batch, unused, until the next prefill's join drops them in the copy it makes anyway, until half the rows are
        such, until one would widen the batch past its charge, or until the plan asks (then one copy drops them): a
        copy of the whole cache at every leave took 9 % of the engine's thread at c=16 (py-spy)."""
        self.released, self.peak_bytes = [], self._cache.nbytes
        staying = {seq.id for seq in plan.running}
        self._rows = [seq if seq is not None and seq.id in staying else None for seq in self._rows]
        if self._partial is not None and self._partial[0].id not in staying:
            self._release([self._partial[0]])
            self._partial = None
        left = self._rows.count(None)
        crowded = not plan.prefill and 2 * left > len(self._rows)
        if left and (left == len(self._rows) or crowded or plan.drop_left or self._too_wide()):
            self._compact()
        tokens = self._decode() if self._rows else []
        if plan.chunk is not None:
            tokens += self._next_chunk(plan.chunk)
        elif plan.prefill:
            tokens += self._prefill(list(plan.prefilling))
        if not self._rows and self._partial is None:  # it holds nothing now
            self.peak_bytes = 0
        return tokens

    def reset(self) -> None:
        """Forget the batch (after a failed run: the cache may be half-updated)."""
        forgotten = [*self._owners, *([self._partial[0]] if self._partial else [])]
        self._cache.clear()
        self._rows, self._owners, self._partial = [], [], None
        self._release(forgotten)

    def _too_wide(self) -> bool:
        """Whether the next step would widen the batch past the width its rows were charged for: a row that left
        rides along and is fed one more position each step, past its own end (and at last past the context)."""
        return self._cache.width + 1 > charged_width([s.kv_tokens for s in self._owners], self._max_len)

    def _staying(self) -> list[int]:
        return [r for r, seq in enumerate(self._rows) if seq is not None]

    def _compact(self) -> None:
        rows = self._staying()
        before = self._cache.nbytes
        self._cache.keep(rows)
        self._note(before + self._cache.nbytes)  # the old arrays and the kept rows' copy
        self._drop_left(rows)

    def _drop_left(self, rows: list[int], joining: list[Sequence] | tuple = ()) -> None:
        """Only these rows stay (in this order), then `joining`'s rows: the others' sequences are released."""
        kept = set(rows)
        dropped = [seq for r, seq in enumerate(self._owners) if r not in kept]
        self._rows = [self._rows[r] for r in rows] + list(joining)
        self._owners = [self._owners[r] for r in rows] + list(joining)
        self._release(dropped)

    def _release(self, seqs: list[Sequence]) -> None:
        """These hold nothing here any more, unless a row of theirs stays (a resumed sequence's new one)."""
        owners = {seq.id for seq in self._owners}
        self.released += [seq for seq in seqs if seq.id not in owners]

    def _note(self, held: int) -> None:
        self.peak_bytes = max(self.peak_bytes, held)

    def _decode(self) -> list[tuple[Sequence, int]]:
        # a row that left is fed padding; its token is not sampled
        tokens = np.array([self._pad_id if seq is None else seq.next_input for seq in self._rows], np.int64)  # (B,)
        logits, present = self._run(self._cache.decode_feeds(tokens))  # (B, 1, V), (B, kv, W + 1, hs) per layer
        self._note(self._cache.nbytes + nbytes(present) + self._partial_bytes())
        self._cache.advance(present)
        rows = self._staying()
        return sample_next([self._rows[r] for r in rows], logits[rows, -1])

    def _prefill(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One run for whole prompts, right-aligned as the batch's rows are, with an empty past."""
        now = time.perf_counter()
        contexts = [seq.context for seq in seqs]  # a resumed sequence recomputes its tokens so far too
        lengths = np.array([len(c) for c in contexts], np.int64)  # (n,)
        width = int(lengths.max())
        ids = np.full((len(seqs), width), self._pad_id, np.int64)  # (n, P)
        mask = np.zeros((len(seqs), width), np.int64)  # (n, P)
        for row, (seq, context) in enumerate(zip(seqs, contexts, strict=True)):
            seq.started = seq.started or now
            ids[row, width - len(context) :] = context
            mask[row, width - len(context) :] = 1
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)  # (n, P): 0 from each prompt's first token
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions, **self._cache.empty_feeds(len(seqs))}
        logits, present = self._run(feeds)  # (n, P, V), (n, kv, P, hs) per layer
        self._note(self._cache.nbytes + nbytes(present))
        self._join(seqs, present, lengths)
        for row, seq in enumerate(seqs):
            note_prompt(seq, logits[row, width - lengths[row] :], 0)  # (n, P, V): right-aligned
        return sample_next(seqs, logits[:, -1])  # the last column is every prompt's last token: right-aligned

    def _next_chunk(self, chunk: Chunk) -> list[tuple[Sequence, int]]:
        """A chunk of a prompt on the past of those before it (1, kv, done, hs), empty for its first; once its last
        has run, the sequence joins the batch with its first token."""
        seq = chunk.seq
        if chunk.start:
            assert self._partial is not None and self._partial[0] is seq
            past = self._partial[1]
        else:
            seq.started = seq.started or time.perf_counter()
            past = self._cache.empty_feeds(1)
        done = _width(next(iter(past.values())))
        context = seq.context
        ids = np.asarray(context[done : done + chunk.count], np.int64)[None]  # (1, n)
        end = done + ids.shape[1]
        feeds = {
            INPUT_IDS: ids,
            ATTENTION_MASK: np.ones((1, end), np.int64),  # (1, done + n)
            POSITION_IDS: np.arange(done, end, dtype=np.int64)[None],  # (1, n)
            **past,
        }
        logits, present = self._run(feeds)  # (1, n, V), (1, kv, done + n, hs) per layer
        note_prompt(seq, logits[0], done)
        self._note(self._cache.nbytes + nbytes(past) + nbytes(present))
        if end < len(context):
            self._partial = (seq, dict(zip(self._cache.past_names, present, strict=True)))
            return []
        self._partial = None
        self._join([seq], present, np.array([end], np.int64))
        return sample_next([seq], logits[:, -1])

    def _partial_bytes(self) -> int:
        return nbytes(self._partial[1]) if self._partial is not None else 0

    def _join(self, seqs: list[Sequence], present: Past, lengths: np.ndarray) -> None:
        staying = self._staying()
        before = self._cache.nbytes + nbytes(present)
        self._cache.join(present, lengths, staying)
        self._note(before + self._cache.nbytes)  # the old arrays, the prefill's present and the merged copy
        self._drop_left(staying, seqs)

    def _run(self, feeds: dict[str, np.ndarray | ort.OrtValue]) -> tuple[np.ndarray, Past]:
        return run_step(self._session, self._outputs, feeds, self._cache.device)


def sample_next(seqs: list[Sequence] | tuple[Sequence, ...], logits: np.ndarray) -> list[tuple[Sequence, int]]:
    """(n, V) logits of each sequence's last position -> each sequence with its next token (and its logprobs, for
    those that ask)."""
    tokens = sample(logits, [s.params for s in seqs], [s.rng for s in seqs])  # (n,)
    asking = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if asking:
        top = max(seqs[row].params.logprobs or 0 for row in asking)
        for row, found in zip(asking, logprobs_of(logits[asking], tokens[asking], top), strict=True):
            seqs[row].logprobs = replace(found, top=found.top[: seqs[row].params.logprobs])
    return list(zip(seqs, tokens.tolist(), strict=True))


def note_prompt(seq: Sequence, logits: np.ndarray, first: int) -> None:
    """`logits` (T, V) of positions first .. first + T - 1 of `seq`'s context: the logprobs they give its prompt's
    next tokens, kept for its first event, when its params ask (a resumed sequence's were sent already)."""
    if seq.prompt_sent or first + 1 != len(seq.prompt_logprobs):  # entries: the first token's, then a position's each
        return
    end = min(first + len(logits), len(seq.prompt) - 1)  # position p gives token p + 1's
    if end > first:
        following = np.asarray(seq.prompt[first + 1 : end + 1], np.int64)  # (end - first,)
        seq.prompt_logprobs += logprobs_of(logits[: end - first], following, seq.params.prompt_logprobs or 0)


def _width(value: np.ndarray | ort.OrtValue) -> int:
    """W of a cached (B, kv, W, hs) array or OrtValue."""
    return int(value.shape()[2] if isinstance(value, ort.OrtValue) else value.shape[2])


def cache_device(runtime: DecoderRuntime, io_binding: bool | None) -> str | None:
    """Where the KV cache is kept between steps: the session's device with ORT I/O binding ("cuda", or "cpu" when
    asked for there), or None for plain numpy arrays; `io_binding` None: bound on the GPU only."""
    bound = runtime.backend == "gpu" if io_binding is None else io_binding
    return ("cuda" if runtime.backend == "gpu" else "cpu") if bound else None


def run_step(
    session: ort.InferenceSession, outputs: list[str], feeds: dict[str, np.ndarray | ort.OrtValue], device: str | None
) -> tuple[np.ndarray, Past]:
    """One run: the logits (outputs[0]) on the host, and `present` (the other outputs) as numpy arrays, or with a
    `device` as OrtValues left there (bound to its memory)."""
    if device is None:
        logits, *present = session.run(None, feeds)
        return logits, present
    binding = session.io_binding()
    for name, value in feeds.items():
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
        else:
            binding.bind_cpu_input(name, value)
    binding.bind_output(outputs[0], "cpu")
    for name in outputs[1:]:
        binding.bind_output(name, device)
    session.run_with_iobinding(binding)
    logits, *present = binding.get_outputs()
    return logits.numpy(), present
