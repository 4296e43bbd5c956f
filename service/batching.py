"""Dynamic batching in process: requests for one model merged into ORT runs padded to their longest sequence.

No wait when idle; while a run is in flight the next batch collects what arrives, up to `max_batch_size` rows; a
bounded wait list answers OverCapacityError. The arithmetic (merge, split) is pure numpy. No torch, no Ray.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from export.tokenizer import PAD_ID
from service.errors import ModelQueueFullError

RunFn = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (N, T) ids, (N, T) mask -> (N, C) logits
BatchHook = Callable[[int, int, float, list[float]], None]  # rows, padded tokens, run seconds, queue wait per request


def effective_length(mask: np.ndarray) -> int:
    """Columns up to the last one where any row has a real token (trailing all-padding columns are dropped)."""
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


@dataclass
class _Waiting:
    ids: np.ndarray  # (n, T)
    mask: np.ndarray  # (n, T)
    future: asyncio.Future
    arrived: float


class DynamicBatcher:
    """One per model: a single runner feeds ORT up to `max_runs` batches at a time on `executor` (off the event
    loop). With max_runs 2 and a 2-thread session, a lone batch runs on both threads and two batches run side by
    side, each on about one core, instead of queueing for both."""

    def __init__(self, name: str, run: RunFn, executor: Executor, policy: BatchPolicy, on_batch: BatchHook):
        self.name = name
        self._run, self._executor, self._policy, self._on_batch = run, executor, policy, on_batch
        self._waiting: deque[_Waiting] = deque()
        self._waiting_rows = 0
        self._grown = asyncio.Event()  # set when a request joins the wait list (for max_wait_s)
        self._runner: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()  # batches in flight beside the runner's own (max_runs > 1)
        self._run_done = asyncio.Event()  # set when one of them finishes

    async def infer(self, ids: np.ndarray, mask: np.ndarray) -> BatchResult:
        """(n, T) ids and mask -> this request's result; more rows than a batch holds run as several chunks."""
        step = self._policy.max_batch_size
        starts = range(0, ids.shape[0], step)
        if len(self._waiting) + len(starts) > self._policy.max_queued_requests:
            raise ModelQueueFullError(self.name)
        if len(starts) == 1:
            return await self._enqueue(ids, mask)
        parts = await asyncio.gather(*[self._enqueue(ids[i : i + step], mask[i : i + step]) for i in starts])
        logits = np.concatenate([p.logits for p in parts])  # (n, C)
        slowest = max(p.queue_s for p in parts)
        return BatchResult(logits, max(p.batch_rows for p in parts), slowest, sum(p.run_s for p in parts))

    def _enqueue(self, ids: np.ndarray, mask: np.ndarray) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append(_Waiting(ids, mask, future, time.perf_counter()))
        self._waiting_rows += ids.shape[0]
        self._grown.set()
        if self._runner is None:
            self._runner = loop.create_task(self._drain())
        return future

    def _take(self) -> list[_Waiting]:
        """The oldest waiting requests that fit one batch; requests whose client went away are dropped."""
        batch, rows = [], 0
        while self._waiting:
            item = self._waiting[0]
            if not item.future.done() and batch and rows + item.ids.shape[0] > self._policy.max_batch_size:
                break
            self._waiting.popleft()
            self._waiting_rows -= item.ids.shape[0]
            if not item.future.done():  # done before its run: cancelled, its client disconnected
                batch.append(item)
                rows += item.ids.shape[0]
        return batch

    async def _window(self) -> None:
        """With max_wait_s > 0: wait until a batch is full or its oldest request has waited max_wait_s."""
        deadline = self._waiting[0].arrived + self._policy.max_wait_s
        while self._waiting_rows < self._policy.max_batch_size and (left := deadline - time.perf_counter()) > 0:
            self._grown.clear()
            try:
                await asyncio.wait_for(self._grown.wait(), left)
            except TimeoutError:
                return

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                if len(self._running) >= self._policy.max_runs:  # only with max_runs > 1: those run as tasks
                    self._run_done.clear()  # every slot is taken: the next batch grows until one frees
                    await self._run_done.wait()
                    continue
                if self._policy.max_wait_s > 0:
                    await self._window()
                if not (batch := self._take()):
                    continue
                if self._policy.max_runs == 1:
                    await self._run_batch(batch, loop)  # the common case: no task per batch
                    continue
                task = loop.create_task(self._run_batch(batch, loop))
                self._running.add(task)
                task.add_done_callback(self._finished)
        finally:
            self._runner = None

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._run_done.set()

    async def _run_batch(self, batch: list[_Waiting], loop: asyncio.AbstractEventLoop) -> None:
        ids, mask, rows = merge([(w.ids, w.mask) for w in batch])  # (N, T) each, T = longest in batch
        start = time.perf_counter()
        try:
            logits = await loop.run_in_executor(self._executor, self._run, ids, mask)
        except Exception as exc:  # the run's failure is every request's answer; the runner goes on
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(exc)
            return
        run_s = time.perf_counter() - start
        for w, part in zip(batch, split(logits, rows), strict=True):
            if not w.future.done():
                w.future.set_result(BatchResult(part, ids.shape[0], start - w.arrived, run_s))
        self._on_batch(ids.shape[0], ids.size, run_s, [start - w.arrived for w in batch])
