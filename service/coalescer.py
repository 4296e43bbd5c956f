"""Ingress-side request coalescing: requests for one model that wait in this ingress replica go to the model's
deployment together, one Ray call per group, so the per-call cost of a hop is paid per group, not per request.

A bounded wait list (the model's `max_queued_requests`) answers 503 when full; a group whose clients all went away
is cancelled and frees its slot, whether or not its call ever answers. No torch.
"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np
from ray.serve.handle import DeploymentHandle

from service.errors import ModelQueueFullError
from service.remote_calls import answer_of

Waiting = tuple[np.ndarray, np.ndarray, asyncio.Future]


class Coalescer:
    """One per model in each ingress replica: at most `in_flight` group calls at once; a group holds what queued
    meanwhile, up to `max_rows` rows (the model's max_batch_size, so one group fits one ORT batch)."""

    def __init__(self, name: str, handle: DeploymentHandle, max_rows: int, max_queued: int, in_flight: int = 2):
        self.name = name
        self._handle = handle
        self._max_rows = max_rows
        self._max_queued = max_queued
        self._slots = asyncio.Semaphore(in_flight)
        self._waiting: deque[Waiting] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task | None = None

    async def infer(self, ids: np.ndarray, mask: np.ndarray):
        """(n, T) ids and mask -> the model's BatchResult for these rows."""
        if len(self._waiting) >= self._max_queued:
            raise ModelQueueFullError(self.name)
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((ids, mask, future))
        self._wake.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_loop())
        return await future

    def _next_group(self) -> list[Waiting]:
        """The oldest waiting requests that fit `max_rows`, those whose client went away (cancelled) left out; may
        be empty when every waiting request was cancelled."""
        group, rows = [], 0
        while self._waiting:
            ids, _, future = self._waiting[0]
            if future.done():  # cancelled: its client is gone, the model need not run its rows
                self._waiting.popleft()
                continue
            if group and rows + ids.shape[0] > self._max_rows:
                break
            group.append(self._waiting.popleft())
            rows += ids.shape[0]
        return group

    async def _send_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                await self._slots.acquire()  # the wait list grows meanwhile: the next group takes it all
                group = self._next_group()
                if not group:
                    self._slots.release()
                    continue
                asyncio.get_running_loop().create_task(self._send(group))

    async def _send(self, group: list[Waiting]) -> None:
        departures = None
        try:
            call = self._handle.infer_many.remote([(ids, mask) for ids, mask, _ in group])
            departures = _Departures([future for *_, future in group], call)
            results = await answer_of(self.name, call)
        except asyncio.CancelledError:
            if departures is None or not departures.all_gone:
                raise
            # every client went away first: the call is cancelled and its slot freed, whether or not it ever answers
        except Exception as exc:  # a full queue, a lost replica or the model's own error: every request's answer
            for *_, future in group:
                _fail(future, exc)
        else:
            for (*_, future), result in zip(group, results, strict=True):
                if isinstance(result, Exception):  # one request's own error (e.g. over capacity in the replica)
                    _fail(future, result)
                elif not future.done():
                    future.set_result(result)
        finally:
            if departures is not None:
                departures.settled = True  # set before the callbacks of the answers just given run
            self._slots.release()


class _Departures:
    """Counts a group's requests as they end; when every one has ended before the call settled (each client went
    away), cancels the call and the task awaiting it: a call that never answers must not hold its slot for ever."""

    def __init__(self, futures: list[asyncio.Future], call) -> None:
        sender = asyncio.current_task()  # the task awaiting the call
        assert sender is not None
        self._open, self._call, self._sender = len(futures), call, sender
        self.settled = self.all_gone = False
        for future in futures:
            future.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Future) -> None:
        self._open -= 1
        if self._open == 0 and not self.settled:
            self.all_gone = True
            self._call.cancel()
            self._sender.cancel()


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
