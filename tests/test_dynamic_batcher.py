"""The in-process dynamic batcher, on a real thread pool and a run function that records its batches: no wait when
idle, batches grow while a run is in flight, rows capped, a bounded wait list, departed clients skipped."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from service.batching import BatchPolicy, DynamicBatcher
from service.errors import OverCapacityError


class SlowModel:
    """logits[i] = (sum of row i's tokens, its length); each run takes `seconds` and is recorded as (rows, width)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.runs: list[tuple[int, int]] = []
        self.alone: list[bool] = []  # per run: whether the batcher said it started with no other run in flight
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, ids: np.ndarray, mask: np.ndarray, alone: bool = True) -> np.ndarray:
        self.gate.wait(5)
        time.sleep(self.seconds)
        self.runs.append(ids.shape)
        self.alone.append(alone)
        return np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1)], axis=1).astype(np.float32)  # (N, 2)


def rows(n: int, length: int, start: int = 1) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(start, start + n * length, dtype=np.int64).reshape(n, length)  # (n, length)
    return ids, np.ones_like(ids)


def expected(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1)], axis=1).astype(np.float32)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.fixture
def pool():
    with ThreadPoolExecutor(1) as executor:
        yield executor


def batcher(model, pool, quiet=None, **policy) -> tuple[DynamicBatcher, list]:
    batches: list = []
    hook = lambda n, tokens, run_s, waits: batches.append((n, tokens, len(waits)))  # noqa: E731
    return Caller(DynamicBatcher("m", model, pool, BatchPolicy(**policy), hook), quiet), batches


class Caller:
    """The batcher as the ingress calls it: each request says whether it is alone, as `quiet()` says (what the HTTP
    server knows); without `quiet`, never alone."""

    def __init__(self, batcher: DynamicBatcher, quiet) -> None:
        self._batcher, self._quiet = batcher, quiet

    async def infer(self, ids, mask):
        return await self._batcher.infer(ids, mask, self._quiet is not None and self._quiet())


def test_an_idle_batcher_runs_a_request_at_once_alone(pool):
    model = SlowModel()
    b, batches = batcher(model, pool, max_wait_s=0.0)

    async def one():
        start = time.perf_counter()
        result = await b.infer(*rows(2, 3))
        return result, time.perf_counter() - start

    result, seconds = run(one())
    np.testing.assert_array_equal(result.logits, expected(*rows(2, 3)))
    assert model.runs == [(2, 3)] and batches == [(2, 6, 1)] and result.batch_rows == 2
    assert seconds < 1.0 and result.queue_s < seconds


def test_requests_arriving_during_a_run_share_the_next_batch_padded_to_the_longest(pool):
    model = SlowModel(seconds=0.05)
    b, _ = batcher(model, pool, max_batch_size=32)
    requests = [rows(1, 2, 1)] + [rows(1 + i % 2, 3 + i, 100 * i) for i in range(1, 6)]

    async def burst():
        first = asyncio.ensure_future(b.infer(*requests[0]))
        await asyncio.sleep(0.01)  # the first run is in flight: the others queue behind it
        return await asyncio.gather(first, *(b.infer(*r) for r in requests[1:]))

    results = run(burst())
    assert model.runs == [(1, 2), (sum(r[0].shape[0] for r in requests[1:]), 8)]  # width: the longest, 8 tokens
    for (ids, mask), result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.logits, expected(ids, mask))


def test_a_batch_never_holds_more_than_max_batch_size_rows(pool):
    model = SlowModel()
    model.gate.clear()  # hold the first run so that everything else queues
    b, _ = batcher(model, pool, max_batch_size=4)

    async def queued():
        first = asyncio.ensure_future(b.infer(*rows(2, 2)))
        await asyncio.sleep(0.02)  # an idle batcher runs it at once, alone; the run is held
        tasks = [asyncio.ensure_future(b.infer(*rows(n, 2, 10 * i))) for i, n in enumerate([1, 3, 2, 2, 1, 4])]
        await asyncio.sleep(0.05)
        model.gate.set()
        return await asyncio.gather(first, *tasks)

    run(queued())
    # the six queue behind the held run; FIFO, each batch as full as the next request allows
    assert [n for n, _ in model.runs] == [2, 1 + 3, 2 + 2, 1, 4]


def test_the_next_batch_starts_when_a_run_ends_even_while_the_event_loop_is_busy(pool):
    model = SlowModel()
    model.gate.clear()
    started: list[float] = []
    b, _ = batcher(lambda ids, mask, alone: (started.append(time.perf_counter()), model(ids, mask))[1], pool)

    async def busy_loop():
        first = asyncio.ensure_future(b.infer(*rows(1, 2)))
        await asyncio.sleep(0.02)  # running, held at the gate
        second = asyncio.ensure_future(b.infer(*rows(1, 3)))
        await asyncio.sleep(0)  # queued behind the held run
        model.gate.set()
        time.sleep(0.3)  # the event loop is busy (blocked) while the first run ends
        unblocked = time.perf_counter()
        await asyncio.gather(first, second)
        return unblocked

    unblocked = run(busy_loop())
    assert model.runs == [(1, 2), (1, 3)]
    assert started[1] < unblocked - 0.1  # the second run did not wait for the event loop to come back


class ConcurrencyProbe(SlowModel):
    """A SlowModel that also records how many of its runs were in flight at once, at most."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self._lock = threading.Lock()
        self.now = self.most = 0

    def __call__(self, ids: np.ndarray, mask: np.ndarray, alone: bool = True) -> np.ndarray:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return super().__call__(ids, mask, alone)
        finally:
            with self._lock:
                self.now -= 1


def test_with_two_runs_allowed_none_starts_beside_a_lone_run_and_what_waited_is_then_shared_between_two():
    model = ConcurrencyProbe(seconds=0.1)
    with ThreadPoolExecutor(2) as two:
        b, _ = batcher(model, two, max_batch_size=32, max_runs=2)
        requests = [rows(1, 2, 10 * i) for i in range(6)]

        async def staggered():
            first = asyncio.ensure_future(b.infer(*requests[0]))
            await asyncio.sleep(0.02)  # the first run is in flight, alone: it has every ORT thread
            rest = [asyncio.ensure_future(b.infer(*r)) for r in requests[1:]]
            return await asyncio.gather(first, *rest)

        results = run(staggered())
    # five rows waited for the lone run to end, then ran as two runs side by side, each told it is not alone
    assert model.runs[0] == (1, 2) and sorted(n for n, _ in model.runs[1:]) == [2, 3]
    assert model.alone == [True, False, False] and model.most == 2
    for (ids, mask), result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.logits, expected(ids, mask))


def test_a_client_that_sends_its_next_request_as_soon_as_it_is_answered_always_runs_alone():
    model = SlowModel()
    with ThreadPoolExecutor(3) as executor:
        b, _ = batcher(model, executor, max_runs=2)

        async def one_after_another():
            for i in range(300):
                await b.infer(*rows(1, 2, i))

        run(one_after_another())
    # the runner is free before the answer reaches the client: the next request never finds a run in flight, and
    # every run of a lone client gets every ORT thread
    assert len(model.alone) == 300 and all(model.alone)


class ThreadRecorder(SlowModel):
    """A SlowModel that also records the thread each run ran on."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(seconds)
        self.threads: list[int] = []

    def __call__(self, ids: np.ndarray, mask: np.ndarray, alone: bool = True) -> np.ndarray:
        self.threads.append(threading.get_ident())
        return super().__call__(ids, mask, alone)


def test_a_short_lone_request_runs_on_the_event_loop_thread_once_its_cost_is_known(pool):
    model = ThreadRecorder(seconds=0.001)
    b, batches = batcher(model, pool, quiet=lambda: True, inline_max_s=1.0)
    requests = [rows(1, 4, 10 * i) for i in range(3)]

    async def one_after_another():
        return threading.get_ident(), [await b.infer(*r) for r in requests]

    loop_thread, results = run(one_after_another())
    # the first run teaches the cost per token (on a runner); the next two, idle and short, run on the loop itself
    assert model.threads[0] != loop_thread and model.threads[1:] == [loop_thread, loop_thread]
    assert model.alone == [True, True, True] and batches == [(1, 4, 1)] * 3
    for (ids, mask), result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.logits, expected(ids, mask))
        assert result.batch_rows == 1


def test_only_a_one_batch_request_of_known_cost_runs_inline(pool):
    model = ThreadRecorder(seconds=0.001)
    b, _ = batcher(model, pool, quiet=lambda: True, inline_max_s=1.0, max_batch_size=2)

    async def sequence():
        await b.infer(*rows(1, 4))  # no lone run yet, nothing known of its cost: on a runner, which learns it
        await b.infer(*rows(3, 4))  # more rows than one batch: chunks, on runners
        ids, mask = rows(1, 4, 7)
        return await b.infer(ids, mask), expected(ids, mask), threading.get_ident()

    now, logits, loop_thread = run(sequence())
    np.testing.assert_array_equal(now.logits, logits)
    assert model.threads[-1] == loop_thread and loop_thread not in model.threads[:-1]


def test_no_request_runs_inline_while_anything_else_is_in_progress_in_the_process(pool):
    model = ThreadRecorder()
    busy = [True]
    b, _ = batcher(model, pool, quiet=lambda: not busy[0], inline_max_s=1.0)

    async def sequence():
        loop_thread = threading.get_ident()
        for i in range(3):
            await b.infer(*rows(1, 2, i))
        busy[0] = False
        await b.infer(*rows(1, 2, 9))
        return loop_thread

    loop_thread = run(sequence())
    assert loop_thread not in model.threads[:3] and model.threads[3] == loop_thread


def test_a_request_expected_to_run_longer_than_inline_max_goes_to_a_runner(pool):
    model = ThreadRecorder(seconds=0.02)  # 20 ms a run: 5 ms per token at 4 tokens
    b, _ = batcher(model, pool, quiet=lambda: True, inline_max_s=0.01)

    async def sequence():
        for length in (4, 4, 1):  # expected 20 ms, 20 ms (over 10: a runner), then 5 ms (inline)
            await b.infer(*rows(1, length))
        return threading.get_ident()

    loop_thread = run(sequence())
    assert model.threads[2] == loop_thread and loop_thread not in model.threads[:2]


def test_a_request_arriving_during_a_run_waits_for_it_rather_than_running_inline(pool):
    model = ThreadRecorder(seconds=0.01)
    b, _ = batcher(model, pool, quiet=lambda: True, inline_max_s=0.5)

    async def sequence():
        await b.infer(*rows(1, 2))  # 5 ms per token from here on
        model.gate.clear()
        held = asyncio.ensure_future(b.infer(*rows(1, 2000)))  # too long for inline: a runner, held at the gate
        await asyncio.sleep(0.05)
        short = asyncio.ensure_future(b.infer(*rows(1, 2)))
        await asyncio.sleep(0.05)
        model.gate.set()
        await asyncio.gather(held, short)
        return threading.get_ident()

    loop_thread = run(sequence())
    assert len(model.threads) == 3 and loop_thread not in model.threads  # the short one ran after, on a runner


class HeldRuns:
    """Each run waits for its own release (runs numbered in start order) and records (rows, alone) when it starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: list[tuple[int, bool]] = []
        self.release = [threading.Event() for _ in range(8)]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, alone: bool) -> np.ndarray:
        with self._lock:
            k = len(self.started)
            self.started.append((ids.shape[0], alone))
        self.release[k].wait(5)
        return expected(ids, mask)

    async def until_started(self, n: int) -> None:
        for _ in range(500):
            if len(self.started) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(self.started)} runs started, expected {n}")


class HeldSubmissions(ThreadPoolExecutor):
    """An executor that holds what is submitted until `open()`, then runs it (and what follows) on its threads."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._held: list | None = []

    def submit(self, fn, /, *args, **kwargs):
        if self._held is not None:
            self._held.append((fn, args, kwargs))
            return None
        return super().submit(fn, *args, **kwargs)

    def open(self) -> None:
        held, self._held = self._held, None
        for fn, args, kwargs in held:
            super().submit(fn, *args, **kwargs)


def test_rows_waiting_with_two_run_slots_free_are_shared_between_two_runs_each_beside_the_other():
    model = HeldRuns()
    with HeldSubmissions(3) as executor:
        b, _ = batcher(model, executor, max_batch_size=32, max_runs=2)

        async def four_then_start():
            requests = [rows(2, 3, 10 * i) for i in range(4)]
            tasks = [asyncio.ensure_future(b.infer(*r)) for r in requests]
            await asyncio.sleep(0.02)  # all four wait: the runner claimed for the first is held
            executor.open()
            await model.until_started(2)
            for event in model.release:
                event.set()
            return requests, await asyncio.gather(*tasks)

        requests, results = run(four_then_start())
    # 8 rows and two free slots: 4 rows each, both runs told they are not alone (each gets one core)
    assert model.started == [(4, False), (4, False)]
    for (ids, mask), result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.logits, expected(ids, mask))


def test_a_request_with_more_rows_than_a_batch_runs_in_chunks_answered_in_order(pool):
    model = SlowModel()
    b, _ = batcher(model, pool, max_batch_size=4)
    ids, mask = rows(10, 3)
    result = run(b.infer(ids, mask))
    np.testing.assert_array_equal(result.logits, expected(ids, mask))
    assert sorted(n for n, _ in model.runs) == [2, 4, 4]


def test_a_full_wait_list_refuses_at_once_and_the_batcher_keeps_serving(pool):
    model = SlowModel()
    model.gate.clear()
    b, _ = batcher(model, pool, max_queued_requests=2)

    async def overflow():
        running = asyncio.ensure_future(b.infer(*rows(1, 2)))
        await asyncio.sleep(0.02)  # taken out of the wait list: running
        waiting = [asyncio.ensure_future(b.infer(*rows(1, 2))) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(OverCapacityError, match="over capacity"):
            await b.infer(*rows(1, 2))
        model.gate.set()
        return await asyncio.gather(running, *waiting)

    assert len(run(overflow())) == 3
    assert run(b.infer(*rows(1, 2))).logits.shape == (1, 2)


def test_a_request_whose_client_went_away_is_not_run(pool):
    model = SlowModel()
    model.gate.clear()
    b, _ = batcher(model, pool)

    async def cancel_one():
        running = asyncio.ensure_future(b.infer(*rows(1, 2)))
        await asyncio.sleep(0.02)
        gone = asyncio.ensure_future(b.infer(*rows(3, 2)))
        kept = asyncio.ensure_future(b.infer(*rows(1, 5)))
        await asyncio.sleep(0)
        gone.cancel()
        model.gate.set()
        return await asyncio.gather(running, kept)

    run(cancel_one())
    assert model.runs == [(1, 2), (1, 5)]


def test_a_failed_run_fails_its_requests_only(pool):
    calls = []

    def flaky(ids, mask, alone):
        calls.append(ids.shape[0])
        if len(calls) == 1:
            raise RuntimeError("ORT failed")
        return expected(ids, mask)

    b, _ = batcher(flaky, pool)
    with pytest.raises(RuntimeError, match="ORT failed"):
        run(b.infer(*rows(1, 2)))
    assert run(b.infer(*rows(2, 2))).logits.shape == (2, 2)


def test_a_batch_window_waits_for_more_rows_up_to_max_wait(pool):
    model = SlowModel()
    b, _ = batcher(model, pool, max_batch_size=8, max_wait_s=0.2)

    async def trickle():
        first = asyncio.ensure_future(b.infer(*rows(1, 2)))
        await asyncio.sleep(0.05)
        return await asyncio.gather(first, b.infer(*rows(2, 2)))

    run(trickle())
    assert model.runs == [(3, 2)]  # both in one run: the first waited for the second
