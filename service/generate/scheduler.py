"""Iteration-level scheduling (Orca, vLLM v1): what the next step computes, sequence by sequence, the runner only
building its inputs: a token for each running sequence whose context has run, and prompt tokens within one budget
(`prefill_chunk` while others decode): the next chunk of a long prompt, or waiting prompts admitted together (in
arrival order, while the KV budget and the running limit allow, and not padded far past their own tokens). The KV
budget is charged for what the cache layout holds: where it is written in place (slot_cache.py), each running
sequence's tokens in whole pages, the youngest preempted when the next step would not fit; else
(service/generate/kv_cache.py) every row it holds, a running sequence's or one that left and is not dropped yet,
times the width the batch may reach, as TGI charges a batch for its padding. Cancelled, aborted and timed-out
sequences leave at once; a sequence whose consumer stops reading is paused (its row dropped) and resumed, recomputed,
when the consumer reads again. A bounded wait: max_waiting, queue_timeout_s. No torch, no HTTP."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from service.errors import ModelQueueFullError, NotReadyError
from service.generate.kv_cache import charged_width
from service.generate.output import ABORT
from service.generate.plan import Chunk, Schedule
from service.generate.sequence import Sequence
from service.generate.slot_cache import charge

PAD_WASTE = 2  # prompts run together pad to the longest: at most this many times their own tokens...
SMALL_PREFILL = 128  # ...unless the run is this small anyway


@dataclass(frozen=True)
class SchedulerState:
    """A snapshot, for tests and metrics (num_requests_running, num_requests_waiting, kv_cache_usage_perc)."""

    running: int
    waiting: int
    kv_reserved_tokens: int  # rows held (running, or left and not dropped yet) x the width they may reach
    kv_budget_tokens: int
    steps: int  # schedules made so far
    draining: bool
    paused: int = 0  # sequences whose consumer stopped reading: no row, no step, until it reads again
    kv_bytes: int = 0  # what the KV cache held at the peak of the last step (past, present and copies)
    kv_budget_bytes: int = 0
    preemptions: int = 0  # running sequences sent back to the queue for room so far (vLLM's num_preemptions)

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV budget's bytes the cache held in the last step, 0 to 1 (vLLM's kv_cache_usage_perc)."""
        return self.kv_bytes / self.kv_budget_bytes if self.kv_budget_bytes else 0.0


@dataclass(frozen=True)
class Limits:
    kv_budget_tokens: int  # rows x width; at least the model's context, so that any valid request can run alone
    max_len: int  # the model's context: no row is wider
    max_running: int
    max_waiting: int
    queue_timeout_s: float
    kv_budget_bytes: int = 0  # what kv_budget_tokens costs in bytes, for the usage gauge
    # 0: the cache is a rectangle of rows x width (service/generate/kv_cache.py); else it is written in place, and each
    # sequence holds its own final length rounded up to whole blocks of this many tokens (slot_cache.py)
    block: int = 0
    prefill_chunk: int = 1 << 62  # prompt tokens (rows x padded width) a step runs while others decode


class Scheduler:
    """Thread-safe: submissions, cancellations, pauses and resumptions come from event loops, `schedule` and `update`
    from the engine's thread; one lock guards everything, held only for list operations."""

    def __init__(self, model: str, limits: Limits) -> None:
        self._model, self._limits = model, limits
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified on a submission, a cancellation, drain and close
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # by id, in admission order
        self._held: dict[int, Sequence] = {}  # left the batch, their rows not dropped yet by the step runner
        self._paused: dict[int, Sequence] = {}  # their consumers stopped reading
        self._kv_bytes = 0
        self._steps = self._preemptions = 0
        self._draining = self._closed = False

    def add(self, seq: Sequence) -> None:
        """Queue `seq`: NotReadyError (503) when draining or closed, ModelQueueFullError (503 + Retry-After) when
        max_waiting sequences already wait."""
        with self._lock:
            if self._draining or self._closed:
                raise NotReadyError(f"model {self._model!r} is shutting down: it takes no new generation requests")
            if len(self._waiting) >= self._limits.max_waiting:
                raise ModelQueueFullError(self._model)
            self._waiting.append(seq)
            self._work.notify()

    def stop(self, seq: Sequence, reason: str) -> None:
        """End `seq` at the next step with `reason` (CANCELLED, ABORT), wherever it is; a no-op once it has ended."""
        with self._lock:
            if seq.stop_reason is None:
                seq.stop_reason = reason
            self._work.notify()

    def pause(self, seq: Sequence) -> None:
        """Stop feeding a running `seq` (its consumer has not taken its events): it leaves the batch at the next
        step, its row dropped like a finished one's, until `resume`."""
        with self._lock:
            if self._running.pop(seq.id, None) is not None:
                self._held[seq.id] = seq
                self._paused[seq.id] = seq

    def resume(self, seq: Sequence) -> None:
        """Feed a paused `seq` again, first in the queue: its prompt and tokens so far are recomputed."""
        with self._lock:
            if self._paused.pop(seq.id, None) is not None:
                self._waiting.appendleft(seq)
                self._work.notify()

    def drain(self) -> None:
        """Take no new sequences; those already queued still run."""
        with self._lock:
            self._draining = True

    def abort_all(self, close: bool = False) -> None:
        """End every waiting, running and paused sequence with ABORT at the next step; `close`: then `schedule`
        returns None and the engine's thread ends."""
        with self._lock:
            for seq in [*self._waiting, *self._running.values(), *self._paused.values()]:
                seq.stop_reason = seq.stop_reason or ABORT
            self._draining = True
            self._closed = self._closed or close
            self._work.notify()

    def schedule(self) -> Schedule | None:
        """The next step's plan; waits while there is nothing to do (rows held count: the step drops them); None once
        closed and empty."""
        with self._lock:
            while not (self._waiting or self._running or self._held or self._paused or self._closed):
                self._work.wait()
            left = self._take_stopped()
            self._preempt()
            decode = tuple(s for s in self._running.values() if not s.pending)
            prefill, drop_left = self._prefill(bool(decode))  # before the timeout: one that can start now does
            expired = self._take_expired(time.perf_counter())
            if self._closed and not (left or expired or decode or prefill or self._held):
                return None
            self._steps += 1
            return Schedule(self._steps, prefill, decode, left, expired, drop_left)

    def update(self, finished: list[Sequence], released: list[Sequence], kv_bytes: int) -> None:
        """After a step: `finished` ended in it (EOS, stop, length, a failed run: their rows stay charged until
        released), the rows of `released` were dropped (their charge is free), and the cache held `kv_bytes`."""
        with self._lock:
            for seq in finished:
                if (self._running.pop(seq.id, None) or self._paused.pop(seq.id, None)) is not None:
                    self._held[seq.id] = seq
            for seq in released:
                self._held.pop(seq.id, None)
            self._kv_bytes = kv_bytes

    def state(self) -> SchedulerState:
        with self._lock:
            return SchedulerState(
                len(self._running),
                len(self._waiting),
                self._reserved(),
                self._limits.kv_budget_tokens,
                self._steps,
                self._draining,
                len(self._paused),
                self._kv_bytes,
                self._limits.kv_budget_bytes,
                self._preemptions,
            )

    def _reserved(self, extra: Sequence | None = None, held: bool = True) -> int:
        """What the rows held (running, left unless not `held`, and `extra`) may reach. Where the cache is written in
        place: their tokens after the next step, each in whole blocks; else rows x the width they may reach. Lock
        held."""
        seqs = [*self._running.values(), *(self._held.values() if held else ()), *([extra] if extra else [])]
        if self._limits.block:
            return sum(charge(s.length, self._limits.block) for s in seqs)
        return len(seqs) * charged_width([s.kv_tokens for s in seqs], self._limits.max_len) if seqs else 0

    def _watermark(self) -> int:
        """Room kept for every running row to grow a block, as vLLM keeps a watermark, so that an admission is not
        preempted at the next step (none where a row is charged the whole context: it never grows). Lock held."""
        block = self._limits.block
        return len(self._running) * block if block < self._limits.max_len else 0

    def _preempt(self) -> None:
        """Where the cache is written in place and the running sequences' next step would not fit the budget, the
        youngest go back to the head of the queue until it does (vLLM's recompute preemption: their rows dropped,
        their prompt and tokens so far recomputed once there is room). Lock held."""
        # rows that left are not counted: the step drops them before it writes
        budget = self._limits.kv_budget_tokens
        while self._limits.block and len(self._running) > 1 and self._reserved(held=False) > budget:
            seq = self._running.pop(next(reversed(self._running)))
            self._waiting.appendleft(seq)
            self._preemptions += 1

    def _take_stopped(self) -> tuple[Sequence, ...]:
        """Cancelled and aborted sequences out of the lists; a running one's row stays charged until dropped. Lock
        held."""
        left = [s for s in self._waiting if s.stop_reason is not None]
        if left:
            self._waiting = deque(s for s in self._waiting if s.stop_reason is None)
        for seq in [s for s in self._running.values() if s.stop_reason is not None]:
            self._held[seq.id] = self._running.pop(seq.id)
            left.append(seq)
        left += [self._paused.pop(s.id) for s in list(self._paused.values()) if s.stop_reason is not None]
        return tuple(left)

    def _take_expired(self, now: float) -> tuple[Sequence, ...]:
        """Waiting sequences that never started, past queue_timeout_s (a resumed one has started). Lock held."""
        limit = self._limits.queue_timeout_s
        expired = tuple(s for s in self._waiting if not s.started and now - s.arrived > limit)
        if expired:
            self._waiting = deque(s for s in self._waiting if s.started or now - s.arrived <= limit)
        return expired

    def _prefill(self, decoding: bool) -> tuple[tuple[Chunk, ...], bool]:
        """This step's prompt tokens, within `prefill_chunk` while others decode (their next token waits for it):
        the next chunk of the prompt running in chunks, else the waiting prompts `_admit` takes (a first one longer
        than the budget starts in chunks). Lock held."""
        budget = self._limits.prefill_chunk if decoding else 1 << 62
        partial = next((s for s in self._running.values() if s.pending), None)
        if partial is not None:
            return (self._chunk(partial, budget),), False
        admitted, drop = self._admit(budget)
        if len(admitted) == 1 and len(admitted[0].context) > budget:
            return (self._chunk(admitted[0], budget),), drop
        for seq in admitted:
            seq.pending = 0
        return tuple(Chunk.whole(seq) for seq in admitted), drop

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> Chunk:
        count = min(seq.pending, budget)
        chunk = Chunk(seq, len(seq.context) - seq.pending, count)
        seq.pending -= count
        return chunk

    def _admit(self, budget: int) -> tuple[tuple[Sequence, ...], bool]:
        """Waiting sequences whose prompts run together this step, in order, and whether the rows that left must be
        dropped this step (before the new ones join) for them to fit. They run together while they fit the KV
        budget and the running limit, and their padded size (rows x the longest) fits `budget` and is at most
        PAD_WASTE times their own tokens (or small), since a short prompt beside a long one costs as much as the long
        one; a first prompt longer than `budget` runs alone, in chunks. The first that cannot join stops admission
        (no overtaking, so a long request is not starved by short ones). Lock held."""
        admitted: list[Sequence] = []
        drop, real, width, room = False, 0, 0, self._limits.kv_budget_tokens
        while self._waiting and len(self._running) < self._limits.max_running:
            seq = self._waiting[0]
            n = len(seq.context)
            if admitted:
                padded = (len(admitted) + 1) * max(width, n)
                if width > budget or padded > budget or padded > max(PAD_WASTE * (real + n), SMALL_PREFILL):
                    break
            if self._limits.block:  # in place: room for its tokens, and a watermark (below); left rows go first
                if self._reserved(seq, held=False) + self._watermark() > room:
                    break
            elif self._reserved(seq, held=not drop) > room:
                if drop or not self._held or self._reserved(seq, held=False) > room:
                    break
                drop = True
            self._waiting.popleft()
            self._running[seq.id] = seq
            seq.pending = n
            admitted.append(seq)
            real, width = real + n, max(width, n)
        return tuple(admitted), drop
