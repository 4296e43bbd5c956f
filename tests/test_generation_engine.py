"""The generation engine on tiny exported decoders (kv_heads 2 and 1): greedy text against a reference loop written
here (numpy and onnxruntime, the whole sequence again at every step), requests joining a running batch mid-way, seeds,
stop strings and finish reasons, typed errors, cancellation, admission within the KV budget, and drain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import mmap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from contract.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from export import decoder_export
from export.decoder import DecoderConfig, DecoderLM
from service.errors import (
    BadRequestError,
    ContextLengthError,
    GenerationFailedError,
    ModelFileError,
    ModelQueueFullError,
    NotReadyError,
    OverCapacityError,
    PromptError,
    QueueTimeoutError,
)
from service.generate import (
    GenerateRequest,
    GenerationEngine,
    GenerationSettings,
    SamplingParams,
    TokenEvent,
    load_decoder,
)
from service.generate.kv_cache import BatchCache, charged_width
from service.generate.output import TextOutput
from service.generate.plan import Chunk, Schedule
from service.generate.runner import StepRunner
from service.generate.scheduler import Scheduler, SchedulerState
from service.generate.sequence import Sequence

KV_HEADS = [2, 1]
HEADS, LAYERS, D_MODEL = 4, 2, 32
MAX_LEN = 256  # long enough that a sequence outlives the test's reaction to its first tokens by hundreds of steps
TIMEOUT_S = 20.0  # each test's asyncio bound
PROMPTS = ["", "def f(x):", "The quick brown fox jumps over the lazy dog. " * 2]


def _model(kv: int) -> DecoderLM:
    torch.manual_seed(100 + kv)
    model = DecoderLM(DecoderConfig(d_model=D_MODEL, heads=HEADS, kv_heads=kv, layers=LAYERS, max_len=MAX_LEN))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # init std 0.02 makes every logit nearly equal; spread them so greedy choices mean something
    return model.eval()


LAYOUTS = ["in-place", "concatenated"]  # the cache written in place (the export's default), or concatenated


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("decoders")
    for layout in LAYOUTS:
        for kv in KV_HEADS:
            model = _model(kv)
            decoder_export.export_decoder(model, model.config.metadata(), out / layout, in_place=layout == "in-place")
    return {layout: out / layout for layout in LAYOUTS}


@pytest.fixture(params=LAYOUTS)
def models_dir(request, exports) -> Path:
    """Each test that takes it runs on both layouts' engines."""
    return exports[request.param]


@pytest.fixture
def concatenated_dir(exports) -> Path:
    return exports["concatenated"]


def _name(kv: int) -> str:
    return f"lm-h{HEADS}-kv{kv}-d{D_MODEL}"


@contextlib.contextmanager
def _engine(models_dir: Path, kv: int = 2, **settings) -> Iterator[GenerationEngine]:
    engine = GenerationEngine.open(models_dir, _name(kv), GenerationSettings(threads=1, **settings))
    try:
        yield engine
    finally:
        engine.close()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def _collect(engine: GenerationEngine, request: GenerateRequest) -> list[TokenEvent]:
    return [event async for event in engine.generate(request)]


def _settled(engine: GenerationEngine) -> SchedulerState:
    """The engine's state once the step after the last sequence's end has dropped its rows (within a second)."""
    deadline = time.monotonic() + 1.0
    while (state := engine.state()).kv_reserved_tokens and time.monotonic() < deadline:
        time.sleep(0.001)
    return state


def _reserved(models_dir: Path, *rows: tuple[int, int]) -> int:
    """What the scheduler charges rows of (tokens so far, final tokens): where the cache is written in place, each
    row's tokens so far in whole pages (per head: 128 tokens here), else rows x the width the finals may reach."""
    if models_dir.name == "in-place":
        block = mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, (D_MODEL // HEADS) * 4)
        return sum(-(-now // block) * block for now, _ in rows)
    return len(rows) * charged_width([final for _, final in rows], MAX_LEN)


def _ids(events: list[TokenEvent]) -> list[int]:
    return [i for e in events for i in e.token_ids]


def _text(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def _greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **more)


def _reference_greedy(folder: Path, kv: int, prompt: list[int], steps: int) -> list[int]:
    """The whole sequence again at every step, past always empty: no cache, no batch, nothing shared."""
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, kv, 0, D_MODEL // HEADS), np.float32)
    past = {f"past_key_values.{i}.{kind}": empty for i in range(LAYERS) for kind in ("key", "value")}
    ids = list(prompt)
    for _ in range(steps):
        x = np.array([ids], np.int64)  # (1, T)
        feeds = {"input_ids": x, "attention_mask": np.ones_like(x), "position_ids": np.arange(x.shape[1])[None, :]}
        logits = session.run(["logits"], {**feeds, **past})[0]  # (1, T, V)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kv", KV_HEADS)
def test_greedy_tokens_and_text_equal_a_reference_loop_without_cache(models_dir, kv):
    tokenizer = ByteTokenizer(MAX_LEN)
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [[BOS_ID, *range(40, 40 + 100)]]  # 1, 10, 91, 101 tokens
    with _engine(models_dir, kv) as engine:
        for prompt in prompts:
            want = _reference_greedy(models_dir / _name(kv), kv, prompt, 24)
            events = _run(_collect(engine, GenerateRequest(prompt, _greedy(24))))
            assert _ids(events) == want, f"prompt of {len(prompt)} tokens"
            assert _text(events) == tokenizer.decode(want)
            assert len(set(want)) > 2  # not one token repeated: the comparison means something
        text_events = _run(_collect(engine, GenerateRequest(PROMPTS[1], _greedy(24))))
        assert _ids(text_events) == _reference_greedy(models_dir / _name(kv), kv, prompts[1], 24)  # BOS prepended
        last = text_events[-1]
        assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == ("length", 10, 24)
        assert 0 < last.timing.first_token_s <= last.timing.total_s
        assert [e.step for e in text_events] == list(range(text_events[0].step, text_events[0].step + 24))


async def _staggered(engine: GenerationEngine, requests: list[GenerateRequest]) -> list[list[TokenEvent]]:
    """Each request submitted once the one before has its first two tokens, while it still runs."""
    streams, firsts = [], []
    for request in requests:
        stream = engine.submit(request)
        firsts.append([await anext(stream), await anext(stream)])
        streams.append(stream)

    async def rest(stream, first):
        return first + [event async for event in stream]

    return await asyncio.gather(*(rest(s, f) for s, f in zip(streams, firsts, strict=True)))


@pytest.mark.parametrize("kv", KV_HEADS)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_requests_joining_a_running_batch_mid_way_generate_what_they_generate_alone(models_dir, kv, sampling):
    def params(i: int) -> SamplingParams:
        if sampling == "greedy":
            return _greedy(150 - 30 * i)
        return SamplingParams(max_tokens=150 - 30 * i, temperature=0.8, top_k=40, top_p=0.95, seed=i, ignore_eos=True)

    requests = [GenerateRequest(p, params(i)) for i, p in enumerate([*PROMPTS, "x"])]
    with _engine(models_dir, kv) as engine:
        alone = [_run(_collect(engine, r)) for r in requests]
        together = _run(_staggered(engine, requests))
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert _ids(t) == _ids(a), f"request {i}"
        assert _text(t) == _text(a)
    joined = [together[i + 1][0].step < together[i][-1].step for i in range(len(requests) - 1)]
    assert all(joined), f"each request started while the one before was running: {joined}"


def test_a_sequence_joining_after_others_left_generates_what_it_generates_alone(models_dir):
    """Rows whose sequences left ride along unused until the next join drops them in its copy: the one that joins
    then, and the one that ran throughout, generate what they generate alone."""
    long, short, late = (GenerateRequest(p, _greedy(n)) for p, n in ((PROMPTS[2], 120), ("x", 3), (PROMPTS[1], 40)))
    with _engine(models_dir) as engine:
        alone = [_ids(_run(_collect(engine, r))) for r in (long, short, late)]

        async def together() -> list[list[TokenEvent]]:
            first = engine.submit(long)
            head = [await anext(first)]
            short_events = await _collect(engine, short)  # runs beside the long one, and leaves
            head.append(await anext(first))  # a step after it left: its row rides along
            late_events = asyncio.ensure_future(_collect(engine, late))  # joins while the long one runs
            rest = [e async for e in first]
            return [head + rest, short_events, await late_events]

        mixed = [_ids(events) for events in _run(together())]
    assert mixed == alone


LONG_PROMPT = [BOS_ID, *range(40, 40 + 100)]  # 101 tokens: 7 chunks of 16


@pytest.mark.parametrize("kv", KV_HEADS)
def test_a_long_prompt_joining_running_streams_runs_in_chunks_while_they_get_a_token_every_step(models_dir, kv):
    """With prefill_chunk 16, a 101-token prompt that arrives while another stream decodes runs over 7 steps, each of
    which also gives the running stream its next token; it generates what it generates alone. Alone (nothing
    decoding), the same prompt runs in one step."""
    running, long = GenerateRequest(PROMPTS[1], _greedy(120)), GenerateRequest(LONG_PROMPT, _greedy(24))
    with _engine(models_dir, kv, prefill_chunk=16) as engine:
        alone = [_run(_collect(engine, r)) for r in (running, long)]
        submitted_alone = _settled(engine).steps  # after the step that drops the last one's row
        assert _run(_collect(engine, long))[0].step == submitted_alone + 1

        async def together() -> tuple[int, list[TokenEvent], list[TokenEvent]]:
            first = engine.submit(running)
            head = await _first_tokens(first, 2)
            submitted = engine.state().steps
            late = asyncio.ensure_future(_collect(engine, long))
            return submitted, head + [e async for e in first], await late

        submitted, running_events, long_events = _run(together())
    assert _ids(long_events) == _ids(alone[1]) == _reference_greedy(models_dir / _name(kv), kv, LONG_PROMPT, 24)
    assert _ids(running_events) == _ids(alone[0])
    assert long_events[0].step - submitted >= 7, "the prompt's 7 chunks took a step each"
    steps = [e.step for e in running_events]
    assert steps == list(range(steps[0], steps[0] + len(steps))), "the running stream had a token at every step"
    assert steps[0] < long_events[0].step < steps[-1]


def test_a_long_prompt_is_not_padded_into_a_batch_of_short_ones(concatenated_dir):
    """Queued together with nothing decoding, four short prompts run as one prefill and the 101-token prompt
    after them in the next step: padded into their batch, each short one would cost as much as the long one. The
    scheduler's plans, run by the runner."""
    runtime = load_decoder(concatenated_dir, _name(2), "cpu", 1)
    shorts = [[BOS_ID, *range(50 + i, 60 + i)] for i in range(4)]  # 11 tokens each

    async def steps() -> list[list[int]]:
        def seq(prompt: list[int]) -> Sequence:
            return Sequence(tuple(prompt), _greedy(4), TextOutput(_greedy(4), EOS_ID, True))

        runner, scheduler = StepRunner(runtime), Scheduler("lm", GenerationSettings().limits(runtime.meta))
        for queued in [*map(seq, shorts), seq(LONG_PROMPT)]:
            scheduler.add(queued)
        first = runner.execute(scheduler.schedule())
        second = runner.execute(scheduler.schedule())
        return [[len(s.prompt) for s, _ in first], [len(s.prompt) for s, _ in second]]

    first, second = _run(steps())
    assert first == [11] * 4, "the short prompts' prefill ran alone"
    assert sorted(second) == [11] * 4 + [101], "then their decoding step and the long prompt's prefill"


def test_a_row_that_left_at_the_full_context_is_dropped_before_its_position_passes_the_context(concatenated_dir):
    """A sequence that filled the context leaves while another goes on (no join to drop its row): riding along, its
    row would be fed position MAX_LEN, past the position embeddings, and the step would fail for every sequence."""
    runtime = load_decoder(concatenated_dir, _name(2), "cpu", 1)

    async def tokens_of_b(with_a: bool) -> list[int]:
        def seq(prompt: list[int]) -> Sequence:
            return Sequence(tuple(prompt), _greedy(8), TextOutput(_greedy(8), EOS_ID, True), asyncio.Queue())

        runner, step = StepRunner(runtime), iter(range(1, 100))
        a = seq([BOS_ID, *(40 + i % 200 for i in range(MAX_LEN - 7))])  # MAX_LEN - 6 tokens
        b = seq([BOS_ID, *range(60, 70)])
        got: list[int] = []
        if with_a:
            runner.execute(Schedule(next(step), (Chunk.whole(a),), (), (), ()))  # a's cache: MAX_LEN - 6 tokens
            runner.execute(Schedule(next(step), (), (a,), (), ()))
        plans = [((b,), (a,) if with_a else ())] + [((), (a, b) if with_a else (b,))] * 3  # a's cache: MAX_LEN - 1
        plans += [((), (b,))] * 6  # a leaves, no join after: its row rides along
        for prefill, decode in plans:
            out = runner.execute(Schedule(next(step), tuple(map(Chunk.whole, prefill)), decode, (), ()))
            got += [token for s, token in out if s is b]
        return got

    assert _run(tokens_of_b(with_a=True)) == _run(tokens_of_b(with_a=False))


def test_a_join_keeps_the_staying_rows_right_aligned_with_zeros_in_every_padding_column(concatenated_dir):
    """BatchCache.join writes into uninitialized arrays: every column left of a row's tokens must be 0 (a NaN there
    would survive its masked-out weight of 0), and the rows that stay, whatever runs they form, keep their tokens."""
    meta = load_decoder(concatenated_dir, _name(2), "cpu", 1).meta
    rng = np.random.default_rng(0)
    cache = BatchCache(meta, np.dtype(np.float32))
    lengths = np.array([3, 7, 5, 2, 6])
    old = [rng.normal(size=(5, 2, 7, 8)).astype(np.float32) for _ in cache.past_names]  # (B, kv, W, hs)
    for past in old:
        for row, n in enumerate(lengths):
            past[row, :, : 7 - n] = 0
    cache.join(old, lengths)  # into an empty cache: these five rows as they are
    new = [rng.normal(size=(2, 2, 9, 8)).astype(np.float32) for _ in cache.past_names]  # (n, kv, P, hs)
    new_lengths = np.array([9, 4])
    for past in new:
        past[1, :, :5] = 0
    kept = [0, 2, 3]  # runs (0), (2, 3)
    # Dirty memory the join's arrays are handed: as many NaN-filled blocks of their very size, freed just before,
    # which the allocator gives back for the next arrays of that size.
    dirty = [np.full((5, 2, 9, 8), np.nan, np.float32) for _ in cache.past_names]
    del dirty
    cache.join(new, new_lengths, kept)
    assert cache.width == 9 and cache.lengths.tolist() == [3, 5, 2, 9, 4]
    for got, before, joined in zip(cache.past, old, new, strict=True):
        want = np.zeros((5, 2, 9, 8), np.float32)
        want[:3, :, 9 - 5 :] = before[kept, :, 7 - 5 :]  # the widest staying row has 5 tokens
        want[3:] = joined
        np.testing.assert_array_equal(got, want)


def test_a_prompt_cancelled_between_its_chunks_frees_its_kv_and_the_running_stream_goes_on(models_dir):
    """prefill_chunk 1: the 101-token prompt takes 101 steps, so it is cancelled between two of its chunks."""
    running, long = GenerateRequest("b", _greedy(200)), GenerateRequest(LONG_PROMPT, _greedy(24))
    with _engine(models_dir, prefill_chunk=1) as engine:
        alone = _ids(_run(_collect(engine, running)))

        async def scenario():
            first = engine.submit(running)
            head = await _first_tokens(first, 2)
            submitted = engine.state().steps
            chunked = engine.submit(long)
            while engine.state().steps < submitted + 3:  # a few of its chunks have run
                await asyncio.sleep(0)
            reserved = engine.state().kv_reserved_tokens
            chunked.cancel()
            while (engine.state().running, engine.state().kv_reserved_tokens) != (
                1,
                _reserved(models_dir, (2, 2 + 200)),
            ):
                await asyncio.sleep(0.001)  # the prompt's part-run cache dropped, its charge freed
            return reserved, head + [e async for e in first]

        reserved, events = _run(scenario())
        assert _settled(engine).kv_reserved_tokens == 0
    # both were running when the prompt was cancelled (the running one under 128 tokens so far)
    assert reserved == _reserved(models_dir, (2, 2 + 200), (101, 101 + 24))
    assert _ids(events) == alone


def test_a_seed_gives_the_same_text_alone_and_batched_and_different_seeds_differ(models_dir):
    def request(seed: int | None, temperature: float = 1.0) -> GenerateRequest:
        return GenerateRequest("Once", SamplingParams(max_tokens=48, temperature=temperature, seed=seed, top_p=0.9))

    async def batched() -> list[TokenEvent]:
        others = [request(None), request(1, 0.0), *[request(seed) for seed in range(100, 106)]]
        results = await asyncio.gather(*(_collect(engine, r) for r in [*others[:4], request(7), *others[4:]]))
        return results[4]

    with _engine(models_dir) as engine:
        alone = _run(_collect(engine, request(7)))
        assert _text(_run(batched())) == _text(alone) and len(_ids(alone)) > 8
        assert _ids(_run(_collect(engine, request(8)))) != _ids(alone)


def test_a_stop_string_spanning_two_tokens_ends_the_text_before_it_and_is_not_returned(models_dir):
    printable = range(32 + 4, 127 + 4)  # ids of printable ASCII bytes: one character each
    with _engine(models_dir) as engine:
        for seed in range(20):
            params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, ignore_eos=True)
            full = _run(_collect(engine, GenerateRequest("Stop", params)))
            ids = _ids(full)
            pairs = [j for j in range(2, len(ids) - 1) if ids[j] in printable and ids[j + 1] in printable]
            if pairs:
                break
        else:
            pytest.fail("no two printable ASCII tokens in a row in 20 seeded generations")
        j = pairs[0]
        stop = chr(ids[j] - 4) + chr(ids[j + 1] - 4)
        text = _text(full)
        stopped = _run(_collect(engine, GenerateRequest("Stop", dataclasses.replace(params, stop=(stop,)))))
    assert _text(stopped) == text[: text.index(stop)]
    assert stop not in _text(stopped)
    last = stopped[-1]
    assert last.finish_reason == "stop" and last.usage.completion_tokens <= j + 2
    assert _ids(stopped) == ids[: last.usage.completion_tokens]  # the stop string's tokens counted, not its text


def test_finish_reasons_length_and_eos_and_ignore_eos_goes_past_eos(models_dir):
    # An EOS found rather than assumed: 64 near-uniform sampled sequences of 63 tokens hold one with ~1 - e^-15.
    def params(seed: int, ignore_eos: bool) -> SamplingParams:
        return SamplingParams(max_tokens=63, temperature=50.0, seed=seed, ignore_eos=ignore_eos)

    async def search(engine) -> list[list[TokenEvent]]:
        return await asyncio.gather(*(_collect(engine, GenerateRequest([BOS_ID], params(s, True))) for s in range(64)))

    with _engine(models_dir, max_running=64) as engine:
        runs = _run(search(engine))
        assert all(r[-1].finish_reason == "length" and r[-1].usage.completion_tokens == 63 for r in runs)
        seeds = [s for s, r in enumerate(runs) if EOS_ID in _ids(r)]
        assert seeds, "no EOS in 64 near-uniform sampled sequences"
        ids = _ids(runs[seeds[0]])
        at = ids.index(EOS_ID)
        ended = _run(_collect(engine, GenerateRequest([BOS_ID], params(seeds[0], False))))
    assert ended[-1].finish_reason == "eos"
    assert _ids(ended) == ids[: at + 1] and ended[-1].usage.completion_tokens == at + 1
    assert _text(ended) == ByteTokenizer(MAX_LEN).decode(ids[:at])


def test_prompt_and_max_tokens_over_the_context_is_a_400_naming_both_numbers(models_dir):
    with _engine(models_dir) as engine:

        async def submit(prompt, max_tokens):
            engine.submit(GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens)))

        with pytest.raises(ContextLengthError) as err:
            _run(submit([BOS_ID] * 200, 57))
        assert err.value.status == 400 and isinstance(err.value, BadRequestError)
        assert "200 tokens + max_tokens 57 = 257" in str(err.value) and "context length of 256" in str(err.value)
        with pytest.raises(ContextLengthError, match="251 tokens \\+ max_tokens 6 = 257"):
            _run(submit("y" * 250, 6))  # BOS + 250 bytes
        _run(submit([BOS_ID] * 200, 56))  # exactly the context: accepted
        bad = [([], "empty"), ([BOS_ID, 260], "260 is outside"), ([-1], "-1 is outside"), (b"ab", "not bytes")]
        for prompt, said in bad:
            with pytest.raises(PromptError, match=said) as err:
                _run(submit(prompt, 4))
            assert err.value.status == 400


async def _first_tokens(stream, n: int) -> list[TokenEvent]:
    return [await anext(stream) for _ in range(n)]


def test_a_cancelled_stream_leaves_the_batch_within_one_step_its_room_goes_to_the_next_and_others_go_on(models_dir):
    long = _greedy(240)
    with _engine(models_dir, kv_cache_tokens=2 * MAX_LEN) as engine:  # room for two full rows
        alone = _run(_collect(engine, GenerateRequest("b", long)))

        async def scenario():
            a, b = engine.submit(GenerateRequest("a", long)), engine.submit(GenerateRequest("b", long))
            await _first_tokens(a, 3)
            c = engine.submit(GenerateRequest("c", _greedy(8)))  # waits: a and b hold the budget
            a.cancel()
            cancelled_at = engine.state().steps  # the step in flight, if any, still has it; the next one has not
            return cancelled_at, [e async for e in b], [e async for e in c]

        cancelled_at, events, third = _run(scenario())
        assert _settled(engine).kv_reserved_tokens == 0
    assert third[0].step == cancelled_at + 1, "c was admitted in a's room in the step after the cancellation"
    assert _ids(events) == _ids(alone) and events[-1].finish_reason == "length"


@pytest.mark.parametrize("how", ["breaks out of its loop", "has its task cancelled"])
def test_a_consumer_that_goes_away_frees_its_sequence(models_dir, how):
    with _engine(models_dir) as engine:

        async def consume(third: asyncio.Event) -> None:
            count = 0
            async for _ in engine.generate(GenerateRequest("a", _greedy(240))):
                count += 1
                third.set() if count == 3 else None
                if count == 3 and how == "breaks out of its loop":
                    break

        async def scenario():
            other = asyncio.create_task(_collect(engine, GenerateRequest("bb", _greedy(240))))
            third = asyncio.Event()
            task = asyncio.create_task(consume(third))
            await third.wait()
            if how == "has its task cancelled":
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            while engine.state().running != 1:  # its row is dropped when room is needed (or at the next join)
                await asyncio.sleep(0.001)
            freed_while_the_other_ran = not other.done()
            return freed_while_the_other_ran, await other

        freed_while_the_other_ran, events = _run(scenario())
    assert freed_while_the_other_ran and events[-1].usage.completion_tokens == 240


def test_a_second_sequence_waits_for_kv_room_until_the_first_leaves(models_dir):
    with _engine(models_dir, kv_cache_tokens=MAX_LEN) as engine:  # room for one context only

        async def both():
            return await asyncio.gather(
                _collect(engine, GenerateRequest("first", _greedy(150))),
                _collect(engine, GenerateRequest("second", _greedy(150))),
            )

        first, second = _run(both())
    assert second[0].step > first[-1].step  # admitted only once the first had left
    assert second[-1].timing.queued_s > 0 and second[-1].usage.completion_tokens == 150
    # the queue time goes out on the first event too (a consumer may leave before the last), and only there
    assert second[0].queued_s == second[-1].timing.queued_s and first[0].queued_s == first[-1].timing.queued_s
    assert all(e.queued_s is None for e in [*first[1:-1], *second[1:-1]])


def test_past_max_waiting_the_answer_is_a_503_at_once(models_dir):
    with _engine(models_dir, kv_cache_tokens=MAX_LEN, max_waiting=1) as engine:

        async def scenario():
            first = engine.submit(GenerateRequest("first", _greedy(200)))
            await anext(first)  # running, and holding the whole budget for ~200 steps
            second = engine.submit(GenerateRequest("second", _greedy(200)))  # waits
            with pytest.raises(ModelQueueFullError) as err:
                engine.submit(GenerateRequest("third", _greedy(4)))
            state = engine.state()
            assert state.waiting == 1 and state.running == 1
            prompt = 1 + len("first")  # BOS, a token per byte
            assert state.kv_reserved_tokens == _reserved(models_dir, (prompt, prompt + 200))
            assert 0 < state.kv_cache_usage <= 1 and state.kv_bytes <= state.kv_budget_bytes
            await first.aclose()
            return err.value, [e async for e in second]

        error, events = _run(scenario())
    assert error.status == 503 and error.headers() == {"Retry-After": "1"}
    assert isinstance(error, OverCapacityError) and "over capacity" in str(error)
    assert events[-1].finish_reason == "length"


def test_past_queue_timeout_the_waiting_sequence_ends_with_a_503(models_dir):
    with _engine(models_dir, kv_cache_tokens=MAX_LEN, queue_timeout_s=0.005) as engine:

        async def scenario():
            first = engine.submit(GenerateRequest("first", _greedy(240)))  # admitted at once, however late
            second = engine.submit(GenerateRequest("second", _greedy(200)))
            with pytest.raises(QueueTimeoutError) as err:
                await anext(second)
            return err.value, [e async for e in first]

        error, events = _run(scenario())
        state = _settled(engine)
    assert error.status == 503 and "Retry-After" in error.headers() and "queue_timeout_s 0.005" in str(error)
    assert events[-1].usage.completion_tokens == 240
    assert state.waiting == 0 and state.kv_cache_usage == 0


def test_drain_refuses_new_requests_and_lets_running_ones_finish(models_dir):
    with _engine(models_dir) as engine:

        async def scenario():
            streams = [engine.submit(GenerateRequest(p, _greedy(150))) for p in ("one", "two")]
            firsts = [await anext(s) for s in streams]
            drained = asyncio.create_task(engine.drain(grace_s=TIMEOUT_S))
            await asyncio.sleep(0)
            with pytest.raises(NotReadyError) as err:
                engine.submit(GenerateRequest("late", _greedy(4)))
            results = [[f, *[e async for e in s]] for f, s in zip(firsts, streams, strict=True)]
            await drained
            return err.value, results

        error, results = _run(scenario())
        assert engine.state().draining
    assert error.status == 503 and "shutting down" in str(error)
    assert [r[-1].finish_reason for r in results] == ["length", "length"]
    assert [r[-1].usage.completion_tokens for r in results] == [150, 150]


def test_drain_past_its_grace_ends_running_and_waiting_sequences_with_abort(models_dir):
    with _engine(models_dir, kv_cache_tokens=MAX_LEN) as engine:

        async def scenario():
            running = engine.submit(GenerateRequest("one", _greedy(200)))
            waiting = engine.submit(GenerateRequest("two", _greedy(200)))  # no room until the first leaves
            first = await anext(running)
            await engine.drain(grace_s=0.0)
            return [first, *[e async for e in running]], [e async for e in waiting]

        running, waiting = _run(scenario())
    assert running[-1].finish_reason == "abort" and 1 <= running[-1].usage.completion_tokens < 200
    assert waiting == [waiting[-1]] and waiting[-1].finish_reason == "abort" and waiting[-1].token_ids == ()
    assert waiting[-1].usage.completion_tokens == 0 and waiting[-1].timing.first_token_s == 0


def test_a_folder_that_is_not_a_decoder_is_refused_saying_why(models_dir, tiny_models_dir):
    with pytest.raises(ModelFileError, match=r"lm-none/model\.onnx is missing"):
        GenerationEngine.open(models_dir, "lm-none", GenerationSettings())
    with pytest.raises(ModelFileError, match="expected 'decoder'"):
        GenerationEngine.open(tiny_models_dir, "mha-h2-d32", GenerationSettings())


def test_a_failing_step_ends_its_sequences_with_a_500_and_the_engine_goes_on(models_dir):
    # A runtime whose metadata says 2 kv heads over the graph of 1: ONNX Runtime refuses the past's shape.
    good = load_decoder(models_dir, _name(2), "cpu", 1)
    wrong = dataclasses.replace(load_decoder(models_dir, _name(1), "cpu", 1), meta=good.meta)
    engine = GenerationEngine(wrong, GenerationSettings(threads=1))
    try:
        for _ in range(2):
            with pytest.raises(GenerationFailedError, match="a decoding step failed") as err:
                _run(_collect(engine, GenerateRequest("x", _greedy(4))))
            assert err.value.status == 500
        assert engine.state().running == 0 and engine.state().kv_reserved_tokens == 0
    finally:
        engine.close()


def test_the_kv_cache_never_holds_more_bytes_than_its_budget_whatever_the_mix_of_lengths(models_dir):
    """One long sequence beside many short ones (the padded rectangle's worst case) under a budget of two full
    rows: the bytes the cache held at every step's peak (past, present and copies, measured on the arrays) stay
    within the budget, while the batch still runs several rows at once."""
    with _engine(models_dir, kv_cache_tokens=2 * MAX_LEN) as engine:
        budget = engine.state().kv_budget_bytes
        peaks, running = [], []

        async def watch(request: GenerateRequest) -> list[TokenEvent]:
            events = []
            async for event in engine.generate(request):
                state = engine.state()
                peaks.append(state.kv_bytes)
                running.append(state.running)
                events.append(event)
            return events

        async def scenario():
            requests = [GenerateRequest("x" * 180, _greedy(60))]
            requests += [GenerateRequest("short", _greedy(12)) for _ in range(24)]
            return await asyncio.gather(*(watch(r) for r in requests))

        results = _run(scenario())
    assert all(r[-1].finish_reason == "length" for r in results)
    assert 0 < max(peaks) <= budget, (max(peaks), budget)
    assert max(running) >= 2


def test_a_consumer_that_stops_reading_pauses_its_sequence_and_gets_the_same_text_once_it_reads(models_dir):
    """The consumer takes nothing: past UNSENT_BYTES of events its sequence is paused (its row dropped, no more
    steps for it) while another runs on; once it reads, the sequence is recomputed and goes on to the same tokens."""
    request = GenerateRequest("def f(x):", _greedy(200))
    with _engine(models_dir) as engine:
        alone = _ids(_run(_collect(engine, request)))

        async def scenario():
            idle = engine.submit(request)
            other = asyncio.create_task(_collect(engine, GenerateRequest("b", _greedy(200))))
            while engine.state().paused == 0:
                assert not other.done(), "the other stream ended before the unread one was paused"
                await asyncio.sleep(0.001)
            paused_at = engine.state().steps
            while engine.state().steps < paused_at + 20:  # steps go on without it
                await asyncio.sleep(0.001)
            events = [e async for e in idle]
            return events, await other

        events, other = _run(scenario())
    steps = [e.step for e in events]
    assert max(b - a for a, b in itertools.pairwise(steps)) >= 20, "no gap: it was fed while paused"
    assert _ids(events) == alone and events[-1].usage.completion_tokens == 200
    assert other[-1].usage.completion_tokens == 200


def test_logprobs_of_greedy_tokens_head_their_alternatives_and_equal_what_the_prompt_gives_them_echoed(models_dir):
    """A greedy completion's logprobs (the chosen token first among 3 alternatives), then the prompt and that
    completion run as one prompt for its logprobs alone (max_tokens 0): the prefill gives the same tokens the same
    logprobs as the decoding steps did, within float error, and reference log-softmax values of a run without cache."""
    prompt = [BOS_ID, *range(50, 70)]
    asked = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    with _engine(models_dir, prefill_chunk=8) as engine:  # the echoed prompt runs in chunks
        events = _run(_collect(engine, GenerateRequest(prompt, asked)))
        generated = _ids(events)
        echo = SamplingParams(max_tokens=0, temperature=0, logprobs=2, prompt_logprobs=2)
        echoed = _run(_collect(engine, GenerateRequest(prompt + generated, echo)))
    steps = [entry for e in events for entry in e.logprobs]
    assert [s.token for s in steps] == generated and all(len(s.top) == 3 for s in steps)
    assert all(s.top[0][0] == s.token and s.top[0][1] == s.logprob >= s.top[1][1] for s in steps)
    assert events[0].prompt_logprobs is None  # not asked
    assert len(echoed) == 1 and echoed[0].finish_reason == "length" and echoed[0].token_ids == ()
    entries = echoed[0].prompt_logprobs
    assert [e.token for e in entries] == prompt + generated and np.isnan(entries[0].logprob)
    np.testing.assert_allclose([e.logprob for e in entries[-12:]], [s.logprob for s in steps], atol=1e-4)
    session = ort.InferenceSession(str(models_dir / _name(2) / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([prompt + generated], np.int64)  # (1, T)
    empty = np.zeros((1, 2, 0, D_MODEL // HEADS), np.float32)
    past = {f"past_key_values.{i}.{kind}": empty for i in range(LAYERS) for kind in ("key", "value")}
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    logits = session.run(["logits"], {**feeds, **past})[0][0].astype(np.float64)  # (T, V)
    reference = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    want = [reference[t - 1, token] for t, token in enumerate(prompt + generated) if t]
    np.testing.assert_allclose([e.logprob for e in entries[1:]], want, atol=1e-4)
    assert all(len(e.top) == 2 for e in entries[1:])
