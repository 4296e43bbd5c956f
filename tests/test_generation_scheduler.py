"""The generation scheduler alone, step by step: admission in arrival order within the KV budget (rows held x the width
they may reach) and the running limit (no overtaking), rows charged until the step runner drops them, leaving at once
(cancelled, aborted, finished), pausing and resuming, the bounded wait (max_waiting, queue_timeout_s), drain and
close."""

from __future__ import annotations

import asyncio

import pytest

from contract.decoder_metadata import IN_PLACE_KERNEL, DecoderMetadata
from contract.tokenizer import EOS_ID
from service.errors import ModelQueueFullError, NotReadyError
from service.generate import ABORT, CANCELLED, GenerationSettings, SamplingParams
from service.generate.kv_cache import LEAVE_SLACK
from service.generate.output import TextOutput
from service.generate.scheduler import Limits, Scheduler
from service.generate.sequence import Sequence


def _seq(prompt: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(tuple(range(prompt)), params, TextOutput(params, EOS_ID, True))


def _scheduler(budget: int = 100, running: int = 8, waiting: int = 8, timeout_s: float = 60.0) -> Scheduler:
    return Scheduler("lm-test", Limits(budget, MAX_LEN, running, waiting, timeout_s))


MAX_LEN = 1000  # wider than any test's rows: a row is charged its final length + LEAVE_SLACK


def _in_loop(body):
    async def run():
        body()

    asyncio.run(run())


def test_sequences_are_admitted_in_arrival_order_charged_rows_times_width_until_their_rows_are_dropped():
    def body():
        assert LEAVE_SLACK == 16  # the arithmetic below
        scheduler = _scheduler(budget=200)
        a, b, c, d = _seq(10, 50), _seq(10, 40), _seq(1, 9), _seq(1, 1)  # they end at 60, 50, 10, 2 tokens
        for seq in (a, b, c, d):
            scheduler.add(seq)
        plan = scheduler.schedule()
        # a and b: 2 rows x (60 + 16) = 152; with c, 3 x 76 = 228 > 200: c waits, and d does not overtake it
        assert plan.prefilling == (a, b) and plan.decode == ()
        state = scheduler.state()
        assert (state.running, state.waiting, state.kv_reserved_tokens, state.kv_budget_tokens) == (2, 2, 152, 200)
        scheduler.update([a], [], 0)  # a finished: its row is still in the cache, so still charged
        assert scheduler.state().kv_reserved_tokens == 152
        plan = scheduler.schedule()  # without a's row, b, c and d are 3 x 66
        assert plan.prefilling == (c, d) and plan.decode == (b,) and plan.drop_left
        scheduler.update([], [a], 0)  # the step runner dropped a's row
        assert scheduler.state().kv_reserved_tokens == 3 * 66

    _in_loop(body)


def test_a_step_is_asked_to_drop_the_rows_that_left_when_they_would_keep_a_waiting_sequence_out():
    def body():
        scheduler = _scheduler(budget=100)
        a, b = _seq(10, 50), _seq(10, 50)  # 76 each: one at a time
        scheduler.add(a)
        assert scheduler.schedule().prefilling == (a,)
        scheduler.update([a], [], 0)
        scheduler.add(b)
        plan = scheduler.schedule()
        assert plan.prefilling == (b,) and plan.drop_left  # a's row goes before b's joins, in the same step
        scheduler.update([], [a], 0)
        assert scheduler.state().kv_reserved_tokens == 76 and not scheduler.schedule().drop_left

    _in_loop(body)


def test_a_paused_sequence_leaves_the_batch_and_resumes_first_in_the_queue():
    def body():
        scheduler = _scheduler(budget=200)
        a, b, c, d = _seq(10, 50), _seq(10, 50), _seq(10, 50), _seq(10, 50)  # 76 each: two at a time
        for seq in (a, b, c):
            scheduler.add(seq)
        assert scheduler.schedule().prefilling == (a, b)
        scheduler.pause(a)
        state = scheduler.state()
        assert (state.running, state.paused, state.kv_reserved_tokens) == (1, 1, 152)  # a's row is not dropped yet
        plan = scheduler.schedule()
        assert plan.decode == (b,) and plan.prefilling == (c,) and plan.drop_left  # a's room goes to c
        scheduler.update([], [a], 0)
        a.started = 1.0  # its prefill had run: a resumed sequence never expires in the queue
        scheduler.add(d)
        scheduler.resume(a)
        scheduler.resume(a)  # once only
        assert scheduler.state().waiting == 2 and scheduler.schedule().prefilling == ()
        scheduler.update([b], [], 0)
        plan = scheduler.schedule()
        assert plan.prefilling == (a,) and plan.decode == (c,) and scheduler.state().paused == 0  # before d

    _in_loop(body)


def test_a_paused_sequence_that_is_cancelled_leaves_with_its_last_event():
    def body():
        scheduler = _scheduler(budget=200)
        a = _seq(10, 50)
        scheduler.add(a)
        scheduler.schedule()
        scheduler.pause(a)
        scheduler.stop(a, CANCELLED)
        plan = scheduler.schedule()
        assert plan.left == (a,) and scheduler.state().paused == 0

    _in_loop(body)


def test_the_running_limit_bounds_a_step_whatever_the_budget():
    def body():
        scheduler = _scheduler(budget=10_000, running=2)
        seqs = [_seq(2, 2) for _ in range(3)]
        for seq in seqs:
            scheduler.add(seq)
        assert scheduler.schedule().prefilling == tuple(seqs[:2])
        assert scheduler.state().waiting == 1

    _in_loop(body)


def test_cancelled_and_aborted_sequences_leave_at_the_next_step_and_their_rows_free_the_budget_when_dropped():
    def body():
        scheduler = _scheduler(budget=112)  # two rows of 40 + 16
        a, b, c = _seq(10, 30), _seq(10, 30), _seq(10, 30)
        for seq in (a, b, c):
            scheduler.add(seq)
        scheduler.schedule()  # a and b run, c waits
        scheduler.stop(a, CANCELLED)
        scheduler.stop(c, ABORT)
        plan = scheduler.schedule()
        assert set(plan.left) == {a, c} and plan.decode == (b,) and plan.prefilling == ()
        assert (a.stop_reason, c.stop_reason) == (CANCELLED, ABORT)
        state = scheduler.state()
        assert (state.running, state.waiting, state.kv_reserved_tokens) == (1, 0, 2 * 56)  # a's row is held
        scheduler.update([], [a], 0)
        assert scheduler.state().kv_reserved_tokens == 56
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
        scheduler = _scheduler(budget=110, timeout_s=0.0)  # every waiting sequence is past its time at once
        a, b = _seq(10, 80), _seq(10, 80)
        scheduler.add(a)
        scheduler.add(b)
        plan = scheduler.schedule()
        assert plan.prefilling == (a,) and plan.expired == (b,)
        assert scheduler.state().waiting == 0

    _in_loop(body)


def test_drain_refuses_new_sequences_but_runs_the_queued_ones_and_close_aborts_the_rest():
    def body():
        scheduler = _scheduler(budget=110)  # one row of 90 + 16
        a, b = _seq(10, 80), _seq(10, 80)
        scheduler.add(a)
        scheduler.add(b)
        scheduler.drain()
        with pytest.raises(NotReadyError, match="shutting down"):
            scheduler.add(_seq(1, 1))
        assert scheduler.schedule().prefilling == (a,)
        scheduler.abort_all(close=True)
        plan = scheduler.schedule()
        assert set(plan.left) == {a, b} and {a.stop_reason, b.stop_reason} == {ABORT}
        assert scheduler.schedule().decode == ()  # one more step, to drop a's row
        scheduler.update([], [a], 0)
        assert scheduler.schedule() is None
        assert scheduler.state().draining

    _in_loop(body)


def test_the_kv_budget_buys_tokens_at_two_copies_of_the_served_precision_and_must_hold_one_context():
    meta = DecoderMetadata("lm-h8-kv8-d512", 8, 8, 64, 512, 4, 260, 128, 1, 2, 0)  # 16 KiB a token in float32
    assert GenerationSettings().kv_budget_tokens(meta) == 128 * 2**20 // (2 * 16384) == 4096
    assert GenerationSettings(kv_cache_mb=64).kv_budget_tokens(meta, itemsize=2) == 4096  # fp16: half a token
    limits = GenerationSettings(kv_cache_tokens=128).limits(meta)
    assert (limits.kv_budget_tokens, limits.kv_budget_bytes, limits.max_len) == (128, 2 * 128 * 16384, 128)
    with pytest.raises(ValueError, match=r"kv_cache_mb=2 \(64 tokens at 2 x 16384 bytes a token\) cannot hold"):
        GenerationSettings(kv_cache_mb=2).kv_budget_tokens(meta)
    with pytest.raises(ValueError, match="at least 4 MiB or 128 tokens"):
        GenerationSettings(kv_cache_tokens=127).kv_budget_tokens(meta)
    with pytest.raises(ValueError, match="max_running=0 must be an integer >= 1; queue_timeout_s=-1"):
        GenerationSettings(max_running=0, queue_timeout_s=-1)
    with pytest.raises(ValueError, match="prefill_chunk=0 must be an integer >= 1"):
        GenerationSettings(prefill_chunk=0)


def test_a_cache_written_in_place_buys_tokens_at_one_copy_in_whole_pages_and_must_hold_one_context():
    meta = DecoderMetadata(
        "lm-h8-kv8-d512", 8, 8, 64, 512, 4, 260, 200, 1, 2, 0, attention_kernel=IN_PLACE_KERNEL
    )  # 16 KiB a token; a head's token 256 bytes: 16 tokens a page
    assert GenerationSettings().kv_budget_tokens(meta) == 128 * 2**20 // 16384 == 8192
    limits = GenerationSettings(kv_cache_tokens=208).limits(meta)
    assert (limits.kv_budget_tokens, limits.kv_budget_bytes, limits.block) == (208, 208 * 16384, 16)
    assert GenerationSettings().rows_held(meta, 96) == 8192 // 96  # 96 tokens: whole pages already
    with pytest.raises(ValueError, match="or 208 tokens"):  # the context, 200, in whole pages
        GenerationSettings(kv_cache_tokens=207).kv_budget_tokens(meta)


def _grow(seq: Sequence, tokens: int) -> None:
    seq.generated += [5] * tokens  # what the engine appends after each step


def test_in_place_running_sequences_are_charged_their_tokens_so_far_and_the_youngest_is_preempted_for_room():
    """Blocks of 16 tokens, a budget of 4 blocks: admission leaves a block of room per running row; a running row
    that grows past the budget sends the youngest back to the head of the queue, counted, with its tokens so far."""

    def body():
        scheduler = Scheduler("lm-test", Limits(64, MAX_LEN, 8, 8, 60.0, block=16))
        a, b, c = _seq(20, 500), _seq(10, 500), _seq(10, 500)  # max_tokens play no part
        for seq in (a, b, c):
            scheduler.add(seq)
        plan = scheduler.schedule()
        # a: 2 blocks; b: 1 more and a block of room for a (4); c would need 5
        assert plan.prefilling == (a, b) and scheduler.state().kv_reserved_tokens == 48
        _grow(a, 13)  # 33 tokens: 3 blocks, with b's 1 within the budget
        assert scheduler.schedule().decode == (a, b) and scheduler.state().preemptions == 0
        _grow(b, 7)  # 17 tokens: 2 blocks, 5 in all
        plan = scheduler.schedule()
        assert plan.decode == (a,) and plan.prefilling == ()
        state = scheduler.state()
        assert (state.running, state.waiting, state.preemptions, state.kv_reserved_tokens) == (1, 2, 1, 48)
        scheduler.update([a], [a], 0)  # a finished and its row dropped
        plan = scheduler.schedule()
        assert plan.prefilling == (b, c)  # b first, recomputing its 17 tokens, then c
        assert scheduler.state().kv_reserved_tokens == 32 + 16

    _in_loop(body)
