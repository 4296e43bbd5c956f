"""The generation scheduler alone, step by step: admission in arrival order within the KV budget and the running limit
(no overtaking, no preemption), leaving at once (cancelled, aborted, finished), the bounded wait (max_waiting,
queue_timeout_s), drain and close."""

from __future__ import annotations

import asyncio

import pytest

from contract.decoder_metadata import DecoderMetadata
from contract.tokenizer import EOS_ID
from service.errors import ModelQueueFullError, NotReadyError
from service.generate import ABORT, CANCELLED, GenerationSettings, SamplingParams
from service.generate.output import TextOutput
from service.generate.scheduler import Limits, Scheduler
from service.generate.sequence import Sequence


def _seq(prompt: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(tuple(range(prompt)), params, TextOutput(params, EOS_ID, True), asyncio.Queue())


def _scheduler(budget: int = 100, running: int = 8, waiting: int = 8, timeout_s: float = 60.0) -> Scheduler:
    return Scheduler("lm-test", Limits(budget, running, waiting, timeout_s))


def _in_loop(body):
    async def run():
        body()

    asyncio.run(run())


def test_sequences_are_admitted_in_arrival_order_within_the_kv_budget_and_freed_when_they_finish():
    def body():
        scheduler = _scheduler(budget=100)
        a, b, c = _seq(10, 50), _seq(10, 40), _seq(1, 9)  # 60, 50, 10 tokens
        for seq in (a, b, c):
            scheduler.add(seq)
        plan = scheduler.schedule()
        assert plan.prefill == (a,) and plan.decode == ()  # b does not fit, and c does not overtake it
        state = scheduler.state()
        assert (state.running, state.waiting, state.kv_reserved_tokens, state.kv_budget_tokens) == (1, 2, 60, 100)
        assert scheduler.schedule().decode == (a,)
        scheduler.finish([a])
        plan = scheduler.schedule()
        assert plan.prefill == (b, c) and plan.decode == ()
        assert scheduler.state().kv_reserved_tokens == 60

    _in_loop(body)


def test_the_running_limit_bounds_a_step_whatever_the_budget():
    def body():
        scheduler = _scheduler(budget=10_000, running=2)
        seqs = [_seq(2, 2) for _ in range(3)]
        for seq in seqs:
            scheduler.add(seq)
        assert scheduler.schedule().prefill == tuple(seqs[:2])
        assert scheduler.state().waiting == 1

    _in_loop(body)


def test_cancelled_and_aborted_sequences_leave_at_the_next_step_with_their_reservation():
    def body():
        scheduler = _scheduler(budget=100)
        a, b, c = _seq(10, 30), _seq(10, 30), _seq(10, 30)
        for seq in (a, b, c):
            scheduler.add(seq)
        scheduler.schedule()  # a and b run, c waits
        scheduler.stop(a, CANCELLED)
        scheduler.stop(c, ABORT)
        plan = scheduler.schedule()
        assert set(plan.left) == {a, c} and plan.decode == (b,) and plan.prefill == ()
        assert (a.stop_reason, c.stop_reason) == (CANCELLED, ABORT)
        state = scheduler.state()
        assert (state.running, state.waiting, state.kv_reserved_tokens) == (1, 0, 40)
        scheduler.stop(a, ABORT)  # already gone: nothing changes
        assert a.stop_reason == CANCELLED and scheduler.schedule().left == ()

    _in_loop(body)


def test_past_max_waiting_a_submission_is_refused_at_once():
    def body():
        scheduler = _scheduler(waiting=2)
        scheduler.add(_seq(1, 1))
        scheduler.add(_seq(1, 1))
        with pytest.raises(ModelQueueFullError, match="'lm-test' is over capacity"):
            scheduler.add(_seq(1, 1))

    _in_loop(body)


def test_a_sequence_waiting_past_queue_timeout_expires_but_one_that_can_start_does():
    def body():
        scheduler = _scheduler(budget=100, timeout_s=0.0)  # every waiting sequence is past its time at once
        a, b = _seq(10, 80), _seq(10, 80)
        scheduler.add(a)
        scheduler.add(b)
        plan = scheduler.schedule()
        assert plan.prefill == (a,) and plan.expired == (b,)
        assert scheduler.state().waiting == 0

    _in_loop(body)


def test_drain_refuses_new_sequences_but_runs_the_queued_ones_and_close_aborts_the_rest():
    def body():
        scheduler = _scheduler(budget=100)
        a, b = _seq(10, 80), _seq(10, 80)
        scheduler.add(a)
        scheduler.add(b)
        scheduler.drain()
        with pytest.raises(NotReadyError, match="shutting down"):
            scheduler.add(_seq(1, 1))
        assert scheduler.schedule().prefill == (a,)
        scheduler.abort_all(close=True)
        plan = scheduler.schedule()
        assert set(plan.left) == {a, b} and {a.stop_reason, b.stop_reason} == {ABORT}
        assert scheduler.schedule() is None
        assert scheduler.state().draining

    _in_loop(body)


def test_a_kv_budget_that_cannot_hold_one_context_is_refused_naming_the_numbers():
    meta = DecoderMetadata("lm-h8-kv8-d512", 8, 8, 64, 512, 4, 260, 128, 1, 2, 0)  # 16 KiB a token
    assert GenerationSettings().kv_budget_tokens(meta) == 4096
    assert GenerationSettings(kv_cache_tokens=128).limits(meta).kv_budget_tokens == 128
    with pytest.raises(ValueError, match=r"kv_cache_mb=1 \(64 tokens at 16384 bytes a token\) cannot hold"):
        GenerationSettings(kv_cache_mb=1).kv_budget_tokens(meta)
    with pytest.raises(ValueError, match="at least 2 MiB or 128 tokens"):
        GenerationSettings(kv_cache_tokens=127).kv_budget_tokens(meta)
    with pytest.raises(ValueError, match="max_running=0 must be an integer >= 1; queue_timeout_s=-1"):
        GenerationSettings(max_running=0, queue_timeout_s=-1)
    with pytest.raises(ValueError, match="prefill_chunk=0 must be an integer >= 1"):
        GenerationSettings(prefill_chunk=0)
