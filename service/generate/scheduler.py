"""Iteration-level scheduling (Orca, vLLM v1): which sequences run the next step. Waiting sequences are admitted in
arrival order while the KV budget (prompt + max_tokens reserved each, no preemption) and the running limit allow;
cancelled, aborted and timed-out ones leave at once. A bounded wait: max_waiting, queue_timeout_s. No torch, no HTTP."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from service.errors import ModelQueueFullError, NotReadyError
from service.generate.output import ABORT
from service.generate.sequence import Sequence


@dataclass(frozen=True)
class Schedule:
    """One step's plan, handed to the step runner and then to the update."""

    step: int
    prefill: tuple[Sequence, ...]  # admitted now: their prompts run, then they join the batch
    decode: tuple[Sequence, ...]  # running already: one token each; every other row leaves the batch
    left: tuple[Sequence, ...]  # ended from outside (cancelled, aborted) since the last step: their last events
    expired: tuple[Sequence, ...]  # waited past queue_timeout_s without starting: they end with QueueTimeoutError


@dataclass(frozen=True)
class SchedulerState:
    """A snapshot, for tests and metrics (num_requests_running, num_requests_waiting, kv_cache_usage_perc)."""

    running: int
    waiting: int
    kv_reserved_tokens: int  # the running sequences' prompt + max_tokens, summed
    kv_budget_tokens: int
    steps: int  # schedules made so far
    draining: bool

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV budget the running sequences reserve, 0 to 1 (vLLM's kv_cache_usage_perc)."""
        return self.kv_reserved_tokens / self.kv_budget_tokens if self.kv_budget_tokens else 0.0


@dataclass(frozen=True)
class Limits:
    kv_budget_tokens: int  # at least the model's context length, so that any valid request can run alone
    max_running: int
    max_waiting: int
    queue_timeout_s: float


class Scheduler:
    """Thread-safe: submissions and cancellations come from event loops, `schedule` and `finish` from the engine's
    thread; one lock guards everything, held only for list operations."""

    def __init__(self, model: str, limits: Limits) -> None:
        self._model, self._limits = model, limits
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified on a submission, a cancellation, drain and close
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # by id, in admission order
        self._reserved = 0
        self._steps = 0
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

    def drain(self) -> None:
        """Take no new sequences; those already queued still run."""
        with self._lock:
            self._draining = True

    def abort_all(self, close: bool = False) -> None:
        """End every waiting and running sequence with ABORT at the next step; `close`: then `schedule` returns
        None and the engine's thread ends."""
        with self._lock:
            for seq in [*self._waiting, *self._running.values()]:
                seq.stop_reason = seq.stop_reason or ABORT
            self._draining = True
            self._closed = self._closed or close
            self._work.notify()

    def schedule(self) -> Schedule | None:
        """The next step's plan; waits while there is nothing to do; None once closed and empty."""
        with self._lock:
            while not (self._waiting or self._running or self._closed):
                self._work.wait()
            left = self._take_stopped()
            decode = tuple(self._running.values())
            prefill = self._admit()  # before the timeout: a sequence that can start now does, however long it waited
            expired = self._take_expired(time.perf_counter())
            if self._closed and not (left or expired or decode or prefill):
                return None
            self._steps += 1
            return Schedule(self._steps, prefill, decode, left, expired)

    def finish(self, seqs: list[Sequence]) -> None:
        """These running sequences ended in a step (EOS, stop, length, a failed run): their reservation is free."""
        with self._lock:
            for seq in seqs:
                if self._running.pop(seq.id, None) is not None:
                    self._reserved -= seq.kv_tokens

    def state(self) -> SchedulerState:
        with self._lock:
            return SchedulerState(
                len(self._running),
                len(self._waiting),
                self._reserved,
                self._limits.kv_budget_tokens,
                self._steps,
                self._draining,
            )

    def _take_stopped(self) -> tuple[Sequence, ...]:
        """Cancelled and aborted sequences out of both lists, their reservations freed. Lock held."""
        left = [s for s in self._waiting if s.stop_reason is not None]
        if left:
            self._waiting = deque(s for s in self._waiting if s.stop_reason is None)
        for seq in [s for s in self._running.values() if s.stop_reason is not None]:
            del self._running[seq.id]
            self._reserved -= seq.kv_tokens
            left.append(seq)
        return tuple(left)

    def _take_expired(self, now: float) -> tuple[Sequence, ...]:
        """Waiting sequences past queue_timeout_s (the oldest are first: stop at the first that is not). Lock held."""
        expired = []
        while self._waiting and now - self._waiting[0].arrived > self._limits.queue_timeout_s:
            expired.append(self._waiting.popleft())
        return tuple(expired)

    def _admit(self) -> tuple[Sequence, ...]:
        """Waiting sequences that fit, in arrival order; the first that does not fit stops admission (no overtaking,
        so a long request is not starved by short ones). Lock held."""
        admitted = []
        while self._waiting and len(self._running) < self._limits.max_running:
            seq = self._waiting[0]
            if self._reserved + seq.kv_tokens > self._limits.kv_budget_tokens:
                break
            self._waiting.popleft()
            self._running[seq.id] = seq
            self._reserved += seq.kv_tokens
            admitted.append(seq)
        return tuple(admitted)
