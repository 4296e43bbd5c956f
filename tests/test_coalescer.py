"""The ingress's coalescer (service/coalescer.py): requests waiting for a model's deployment go as one call per
group, the rows of a request whose client went away while it waited are never sent, and a group whose clients all
went away frees its slot even if its call never answers. The deployment's handle is a stand-in that records what it
is sent: the coalescer, not Serve, is what these tests check."""

from __future__ import annotations

import asyncio

import numpy as np

from service.batching import BatchResult
from service.coalescer import Coalescer


class HeldHandle:
    """A model deployment's handle as the coalescer uses it (`infer_many.remote`, a call it can await and cancel):
    records the first token of each request of each group it is sent, and answers every group once `release` is
    set. A call's `cancel` is recorded and otherwise ignored, as a call stuck in Ray might."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.cancelled: list[bool] = []
        self.release = asyncio.Event()
        self.infer_many = self

    def remote(self, requests: list[tuple[np.ndarray, np.ndarray]]) -> HeldCall:
        self.groups.append([int(ids[0, 0]) for ids, _ in requests])
        self.cancelled.append(False)
        return HeldCall(self, len(self.groups) - 1, self._answer(requests))

    async def _answer(self, requests) -> list[BatchResult]:
        await self.release.wait()
        return [BatchResult(np.zeros((ids.shape[0], 2), np.float32), ids.shape[0], 0.0, 0.0) for ids, _ in requests]


class HeldCall:
    def __init__(self, handle: HeldHandle, index: int, answer) -> None:
        self._handle, self._index, self._answer = handle, index, answer

    def __await__(self):
        return self._answer.__await__()

    def cancel(self) -> None:
        self._handle.cancelled[self._index] = True


def _row(token: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array([[token]], dtype=np.int64), np.ones((1, 1), dtype=np.int64)  # (1, 1) ids and mask


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_request_cancelled_while_it_waits_is_not_sent_and_the_others_of_its_group_are():
    async def scenario() -> list[list[int]]:
        handle = HeldHandle()
        coalescer = Coalescer("m", handle, max_rows=32, max_queued=8, in_flight=1)
        first = asyncio.create_task(coalescer.infer(*_row(1)))
        await _turns()  # the first request's group is in flight, holding the one slot
        gone = asyncio.create_task(coalescer.infer(*_row(2)))
        kept = asyncio.create_task(coalescer.infer(*_row(3)))
        await _turns()  # both wait for the slot
        gone.cancel()
        handle.release.set()
        await asyncio.wait_for(asyncio.gather(first, kept), 5)
        return handle.groups

    assert asyncio.run(scenario()) == [[1], [3]]


def test_a_wait_list_of_only_cancelled_requests_sends_nothing_and_frees_its_slot():
    async def scenario() -> tuple[list[list[int]], int]:
        handle = HeldHandle()
        coalescer = Coalescer("m", handle, max_rows=32, max_queued=8, in_flight=1)
        first = asyncio.create_task(coalescer.infer(*_row(1)))
        await _turns()
        waiting = [asyncio.create_task(coalescer.infer(*_row(t))) for t in (2, 3)]
        await _turns()
        for task in waiting:
            task.cancel()
        handle.release.set()
        await asyncio.wait_for(first, 5)
        await _turns()
        later = await asyncio.wait_for(coalescer.infer(*_row(4)), 5)  # the slot is free again
        return handle.groups, later.logits.shape[0]

    groups, rows = asyncio.run(scenario())
    assert groups == [[1], [4]] and rows == 1


def test_a_group_whose_clients_all_went_away_frees_its_slot_and_is_cancelled_though_its_call_never_answers():
    async def scenario() -> tuple[list[list[int]], list[bool], int]:
        handle = HeldHandle()
        coalescer = Coalescer("m", handle, max_rows=32, max_queued=8, in_flight=1)
        gone = asyncio.create_task(coalescer.infer(*_row(1)))
        await _turns()  # its group's call holds the one slot and will not answer before `release`
        gone.cancel()
        await _turns()
        later = asyncio.create_task(coalescer.infer(*_row(2)))
        await _turns()
        sent = [list(g) for g in handle.groups]  # before `release`: the slot was freed by the departure alone
        handle.release.set()
        answer = await asyncio.wait_for(later, 5)
        return sent, handle.cancelled, answer.logits.shape[0]

    sent, cancelled, rows = asyncio.run(scenario())
    assert sent == [[1], [2]] and cancelled == [True, False] and rows == 1


def test_a_group_with_one_client_left_keeps_its_call_and_answers_that_client():
    async def scenario() -> tuple[list[list[int]], list[bool], int]:
        handle = HeldHandle()
        coalescer = Coalescer("m", handle, max_rows=32, max_queued=8, in_flight=1)
        gone, kept = (asyncio.create_task(coalescer.infer(*_row(t))) for t in (1, 2))
        await _turns()  # one group, [1, 2], sent and held
        gone.cancel()
        await _turns()
        assert not kept.done()
        handle.release.set()
        answer = await asyncio.wait_for(kept, 5)
        return handle.groups, handle.cancelled, answer.logits.shape[0]

    groups, cancelled, rows = asyncio.run(scenario())
    assert groups == [[1, 2]] and cancelled == [False] and rows == 1


def test_the_coalescer_benchmark_measures_this_tree_and_the_versus_tree_in_processes_of_their_own(capsys):
    from benchmarks.coalescer import ROOT, main

    assert main(["--versus", str(ROOT), "--requests", "64", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = [float(part.split()[-1]) for line in lines[1:] for part in line.split(": ", 1)[1].split(", ")]
    assert [line.split()[0] for line in lines[1:]] == ["this", "versus"] and len(figures) == 4
    assert all(value > 0 for value in figures)
