"""Dynamic batching in process: requests for one model merged into ORT runs padded to their longest sequence.

No wait when idle; while a run is in flight the next batch collects what arrives, up to `max_batch_size` rows, and
starts as soon as the run ends, from the ORT thread itself; a bounded wait list answers OverCapacityError. A short
request that its caller says is alone, finding the model idle, runs on the event loop's own thread. The arithmetic
(merge, split) is pure numpy. No torch, no Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from contract.tokenizer import PAD_ID
from service.errors import ModelQueueFullError

RunFn = Callable[[np.ndarray, np.ndarray, bool], np.ndarray]  # (N, T) ids, (N, T) mask, alone -> (N, C) logits
BatchHook = Callable[[int, int, float, list[float]], None]  # rows, padded tokens, run seconds, queue wait per request


def effective_length(mask: np.ndarray) -> int:
    """Columns up to the last one where any row has a real token (trailing all-padding columns are dropped)."""
    if mask[:, -1].any():  # the usual case, no padding at the end: one small reduction
        return mask.shape[1]
    used = np.flatnonzero(mask.any(axis=0))  # (T,) -> indices of columns with a token
    return int(used[-1]) + 1 if used.size else 1


def merge(requests: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(ids, mask) pairs of shapes (n_i, T_i) -> one (sum n_i, max T) pair and the row count of each request."""
    lengths = [effective_length(mask) for _, mask in requests]
    width = max(lengths)
    rows = [ids.shape[0] for ids, _ in requests]
    if len(requests) == 1 and lengths[0] == requests[0][0].shape[1]:  # nothing to pad or trim: no copy
        return requests[0][0], requests[0][1], rows
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
    if len(rows) == 1:
        return [logits]
    return np.split(logits, np.cumsum(rows)[:-1])


@dataclass(frozen=True)
class BatchResult:
    """One request's logits and what it cost (the response's timing and the metrics read these)."""

    logits: np.ndarray  # (n, C) float32
    batch_rows: int  # rows in the ORT run this request shared (the largest, for a request split in chunks)
    queue_s: float  # from arrival to the start of its batch's ORT run
    run_s: float  # ORT run time of the whole batch (summed over chunks)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 32  # rows per ORT run; a request with more rows runs in chunks of this size
    max_queued_requests: int = 256  # requests waiting for a run; one more gets OverCapacityError (503)
    max_wait_s: float = 0.0  # hold a batch that is not full up to this long for more rows; 0: never wait
    max_runs: int = 1  # ORT runs in flight at once (the executor needs as many workers); 1: one batch at a time
    inline_max_s: float = 0.0  # a lone request expected to run at most this long runs on the event loop; 0: never


@dataclass
class _Waiting:
    ids: np.ndarray  # (n, T)
    mask: np.ndarray  # (n, T)
    future: asyncio.Future  # set on its event loop's thread only
    arrived: float


class DynamicBatcher:
    """One per model. Its runners are loops on `executor`'s threads, up to `max_runs` at a time: each takes the oldest
    waiting requests that fit a batch, runs ORT (off the event loop, which goes on reading requests), hands the
    results to the event loop in one call and takes the next batch at once, without waiting for the event loop to get
    round to it; a runner ends when nothing waits. With max_runs > 1, what waits is shared between the free run slots
    and each run is told whether it started alone (nothing else in flight or waiting: the engine gives it every ORT
    thread) or not (side by side, each on its share of the threads); no run starts beside a lone one.

    A request whose caller says it is alone (nothing else in progress in the process) that finds nothing in flight
    or waiting here, with an expected run time (from the last lone runs, per token) of at most `inline_max_s`, runs
    inline on the event loop's thread instead, as bare ORT would: no hand-off to a runner thread and back, and no
    third thread beside ORT's on the cores. The loop is held for that one short run, during which a request for this
    model would have waited for it anyway."""

    def __init__(
        self,
        name: str,
        run: RunFn,
        executor: Executor,
        policy: BatchPolicy,
        on_batch: BatchHook,
    ):
        self.name = name
        self._run, self._executor, self._policy, self._on_batch = run, executor, policy, on_batch
        self._lone_s_per_token: float | None = None  # ORT seconds per padded token of recent lone runs (a mean)
        self._lock = threading.Lock()  # guards everything below: the event loop and the runners share it
        self._grown = threading.Condition(self._lock)  # notified when a request joins the wait list (max_wait_s)
        self._waiting: deque[_Waiting] = deque()
        self._waiting_rows = 0
        self._runners = 0  # runner loops alive
        self._idle = 0  # of those, the ones not in an ORT run (about to take a batch, or in a batch window)
        self._alone_in_flight = False  # a run that started alone (every ORT thread) is in flight: none starts beside it

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False) -> BatchResult:
        """(n, T) ids and mask -> this request's result; more rows than a batch holds run as several chunks.
        `alone`: nothing else is in progress in this process (the caller knows): it may then run inline."""
        step = self._policy.max_batch_size
        starts = range(0, ids.shape[0], step)
        if len(starts) == 1:
            if alone and self._inline_fits(ids):
                return self._run_inline(ids, mask)
            return await self._enqueue([(ids, mask)])[0]
        futures = self._enqueue([(ids[i : i + step], mask[i : i + step]) for i in starts])
        parts = await asyncio.gather(*futures)
        logits = np.concatenate([p.logits for p in parts])  # (n, C)
        slowest = max(p.queue_s for p in parts)
        return BatchResult(logits, max(p.batch_rows for p in parts), slowest, sum(p.run_s for p in parts))

    def busy(self) -> bool:
        """Whether a run is in flight or a request waits for one."""
        with self._lock:
            return self._runners > 0 or bool(self._waiting)

    def _inline_fits(self, ids: np.ndarray) -> bool:
        """Whether this (n, T) request of a lone caller runs inline: the model idle, its run expected short."""
        per_token = self._lone_s_per_token
        if per_token is None or per_token * ids.size > self._policy.inline_max_s:
            return False
        with self._lock:  # no run in flight, nothing waiting; a runner still alive finds nothing and ends
            return self._runners == self._idle and not self._waiting

    def _run_inline(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult:
        """On the event loop's thread: one lone run of one request; its failure is the request's."""
        ids, mask, rows = merge([(ids, mask)])  # (n, T), trailing padding trimmed
        start = time.perf_counter()
        logits = self._run(ids, mask, True)
        run_s = time.perf_counter() - start
        self._learn(run_s, ids.size)
        asyncio.get_running_loop().call_soon(self._on_batch, rows[0], ids.size, run_s, [0.0])  # after the answer
        return BatchResult(split(logits, rows)[0], rows[0], 0.0, run_s)

    def _learn(self, run_s: float, tokens: int) -> None:
        """A lone run's cost per padded token, folded into the running mean the inline check uses."""
        sample = run_s / max(1, tokens)
        last = self._lone_s_per_token
        self._lone_s_per_token = sample if last is None else 0.75 * last + 0.25 * sample

    def _enqueue(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> list[asyncio.Future]:
        """Join the wait list (all parts or none), starting a runner if every live one is busy and a slot is free."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in parts]
        now = time.perf_counter()
        with self._lock:
            if len(self._waiting) + len(parts) > self._policy.max_queued_requests:
                raise ModelQueueFullError(self.name)
            for (ids, mask), future in zip(parts, futures, strict=True):
                self._waiting.append(_Waiting(ids, mask, future, now))
                self._waiting_rows += ids.shape[0]
            self._grown.notify()
            start = self._claim_runner()
        if start:
            self._executor.submit(self._runner)
        return futures

    def _claim_runner(self) -> bool:
        """Whether a new runner must start for what waits: none is free to take it and a slot is. Not beside a run
        that started alone: it has every ORT thread, one more run would oversubscribe the cores (its runner shares
        what waits when it ends). Lock held."""
        if self._idle or self._alone_in_flight or self._runners >= self._policy.max_runs:
            return False
        self._runners += 1
        self._idle += 1
        return True

    def _take(self) -> list[_Waiting]:
        """The oldest waiting requests that fit one batch, and no more than this runner's share of what waits when
        other run slots are free (they take the rest, each run on its share of the threads); requests whose client
        went away are dropped. Lock held."""
        free = self._policy.max_runs - (self._runners - self._idle)  # run slots not in an ORT run, this one's too
        share = min(self._policy.max_batch_size, -(-self._waiting_rows // free))  # ceil(waiting / free slots)
        batch, rows = [], 0
        while self._waiting:
            item = self._waiting[0]
            if not item.future.done() and batch and rows + item.ids.shape[0] > share:
                break
            self._waiting.popleft()
            self._waiting_rows -= item.ids.shape[0]
            if not item.future.done():  # done before its run: cancelled, its client disconnected
                batch.append(item)
                rows += item.ids.shape[0]
        return batch

    def _window(self) -> None:
        """With max_wait_s > 0: wait until a batch is full or its oldest request has waited max_wait_s. Lock held."""
        deadline = self._waiting[0].arrived + self._policy.max_wait_s
        while self._waiting_rows < self._policy.max_batch_size and (left := deadline - time.perf_counter()) > 0:
            self._grown.wait(left)

    def _runner(self) -> None:
        """One runner loop, on an executor thread: batches until nothing waits."""
        while True:
            with self._lock:
                if self._waiting and self._policy.max_wait_s > 0:
                    self._window()
                batch = [] if self._alone_in_flight else self._take()  # what waits then is for the lone run's runner
                if not batch:
                    self._runners -= 1
                    self._idle -= 1
                    return
                self._idle -= 1
                alone = self._runners - self._idle == 1 and not self._waiting  # no other run in flight, none to come
                self._alone_in_flight = alone
                sibling = bool(self._waiting) and self._claim_runner()  # the rest of the share goes beside this run
            if sibling:
                self._executor.submit(self._runner)
            try:
                answer = self._run_batch(batch, alone)
            finally:
                with self._lock:  # free before the answer: a client that sends its next request at once finds it so
                    self._idle += 1
                    if alone:
                        self._alone_in_flight = False
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is left to answer
                batch[0].future.get_loop().call_soon_threadsafe(answer)

    def _run_batch(self, batch: list[_Waiting], alone: bool) -> Callable[[], None]:
        """Merge, run and split on this runner's thread -> what answers the batch on the event loop; whatever fails
        here is every request's answer."""
        try:
            ids, mask, rows = merge([(w.ids, w.mask) for w in batch])  # (N, T) each, T = longest in batch
            start = time.perf_counter()
            parts = split(self._run(ids, mask, alone), rows)
            run_s = time.perf_counter() - start
            if alone:
                self._learn(run_s, ids.size)
            return functools.partial(self._answer, batch, parts, ids.shape, start, run_s)
        except Exception as exc:  # the runner goes on with the next batch
            return functools.partial(self._fail, batch, exc)

    def _answer(
        self, batch: list[_Waiting], parts: list[np.ndarray], shape: tuple[int, int], start: float, run_s: float
    ) -> None:
        """On the event loop: each request's (n, C) logits, then (once the answers are out) the batch's metrics."""
        for w, part in zip(batch, parts, strict=True):
            if not w.future.done():
                w.future.set_result(BatchResult(part, shape[0], start - w.arrived, run_s))
        waits = [start - w.arrived for w in batch]
        batch[0].future.get_loop().call_soon(self._on_batch, shape[0], shape[0] * shape[1], run_s, waits)

    @staticmethod
    def _fail(batch: list[_Waiting], exc: Exception) -> None:
        """On the event loop: the run's failure is the answer of each request still waiting for it."""
        for w in batch:
            if not w.future.done():
                w.future.set_exception(exc)
