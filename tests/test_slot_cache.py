"""The KV cache written in place (service/generate/slot_cache.py) and its step runner: rows bound as past and present,
a leaving row filled by the last one, the pages past each row's end given back to the system (measured in
/proc/self/pagemap, not on the arrays), and the device's row copy graph (service/generate/row_copy.py) as onnx builds
it."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from contract.tokenizer import BOS_ID, EOS_ID
from export import decoder_export
from export.decoder import DecoderConfig, DecoderLM
from service.generate import GenerateRequest, GenerationEngine, GenerationSettings
from service.generate.output import TextOutput
from service.generate.plan import Chunk, Schedule
from service.generate.request import SamplingParams
from service.generate.row_copy import _GRAPHS, RowCopy
from service.generate.sequence import Sequence
from service.generate.session import load_decoder
from service.generate.slot_cache import PAGE, buffer_width, page_tokens
from service.generate.slot_runner import SlotRunner, slot_rows

HEADS, KV, D_MODEL, LAYERS, MAX_LEN = 4, 2, 64, 2, 200  # head_dim 16: 64 bytes a head's token, 64 tokens a page


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    torch.manual_seed(3)
    model = DecoderLM(DecoderConfig(d_model=D_MODEL, heads=HEADS, kv_heads=KV, layers=LAYERS, max_len=MAX_LEN))
    out = tmp_path_factory.mktemp("in-place")
    meta = decoder_export.export_decoder(model.eval(), model.config.metadata(), out).metadata
    assert meta.cache_in_place
    return load_decoder(out, meta.name, "cpu", 1)


def _resident(runner: SlotRunner) -> int:
    """The bytes of the cache's buffers that are resident: their pages present in this process's page table
    (/proc/self/pagemap, bit 63 of each page's entry)."""
    cache, present = runner.cache, 0
    size = cache.capacity * cache._row_bytes
    with open("/proc/self/pagemap", "rb") as pagemap:
        for pointer in cache._pointers:
            pagemap.seek(pointer // PAGE * 8)
            entries = np.frombuffer(pagemap.read(size // PAGE * 8), np.uint64)
            present += int(((entries >> np.uint64(63)) & np.uint64(1)).sum())
    return present * PAGE


def _seq(prompt: list[int], max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Sequence(tuple(prompt), params, TextOutput(params, EOS_ID, True))


def _whole(seqs: list[Sequence] | tuple[Sequence, ...]) -> tuple[Chunk, ...]:
    """Their whole prompts, run together."""
    return tuple(map(Chunk.whole, seqs))


def test_the_buffer_width_is_the_context_in_whole_pages_per_head(runtime):
    meta = runtime.meta
    assert page_tokens(meta, np.dtype(np.float32)) == PAGE // (meta.head_dim * 4) == 64
    assert buffer_width(meta, np.dtype(np.float32)) == 256  # 200 rounded up to 64
    assert page_tokens(meta, np.dtype(np.float16)) == 128


def test_rows_hold_their_own_pages_and_give_them_back_when_they_leave(runtime):
    """Prompts of 3, 70 and 130 tokens (padded to 130 in one prefill), then one of 10: each row keeps only the pages
    of its own tokens; when three leave, the one left moves into row 0 and the rest goes back to the system (and
    reads as zeros)."""

    async def scenario() -> list[int]:
        runner = SlotRunner(runtime, GenerationSettings(max_running=8))
        seqs = [_seq([BOS_ID, *range(40, 40 + n - 1)], 20) for n in (3, 70, 130, 10)]
        before = _resident(runner)
        runner.execute(Schedule(1, _whole(seqs[:3]), (), (), ()))
        runner.execute(Schedule(2, _whole(seqs[3:]), tuple(seqs[:3]), (), ()))  # their decoding step, the fourth's
        block, token = runner.cache.block, runner.cache.token_bytes
        held = [before, _resident(runner), sum(-(-n // block) * block for n in (4, 71, 131, 10)) * token]
        for step in range(3, 6):
            runner.execute(Schedule(step, (), tuple(seqs), (), ()))
        runner.execute(Schedule(6, (), (seqs[2],), (), ()))
        held += [_resident(runner), runner.cache.rows, int(runner.cache.lengths[0]), len(runner.released)]
        # (rows, kv, width, hs): past row 0's tokens, nothing; read last (a page read maps the zero page back)
        buffer = runner.cache._host[0]
        held.append(float(np.abs(buffer[0, :, 192:]).sum() + np.abs(buffer[1:]).sum()))
        return held

    before, after_prefill, charged, after_leave, rows, length, released, unused = asyncio.run(scenario())
    assert before == 0
    assert after_prefill == charged  # 1 + 2 + 3 + 1 pages per head, not 4 x 130 tokens' worth
    assert (rows, length, released) == (1, 131 + 4, 3)
    assert after_leave == 3 * PAGE * KV * 2 * LAYERS  # 135 tokens: 3 pages a head
    assert unused == 0.0


def test_a_row_that_takes_a_leaving_ones_place_generates_what_it_generates_alone(runtime):
    async def tokens(together: bool) -> list[int]:
        runner = SlotRunner(runtime, GenerationSettings(max_running=4))
        first, last = _seq([BOS_ID, 50, 51, 52], 30), _seq([BOS_ID, *range(60, 80)], 30)
        got: list[int] = []
        plans = [((first, last), ()), *[((), (first, last))] * 4, *[((), (last,))] * 10]
        if not together:
            plans = [((last,), ()), *[((), (last,))] * 14]
        for step, (prefill, decode) in enumerate(plans, 1):
            got += [t for s, t in runner.execute(Schedule(step, _whole(prefill), decode, (), ())) if s is last]
        return got

    assert asyncio.run(tokens(True)) == asyncio.run(tokens(False))


def test_the_row_copy_graphs_are_what_onnx_builds():
    for dtype, elem in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "row_copy",
            [helper.make_tensor_value_info("x", elem, ["n"])],
            [helper.make_tensor_value_info("y", elem, ["n"])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8, producer_name="")
        assert _GRAPHS[np.dtype(dtype)] == model.SerializeToString()
        onnx.checker.check_model(onnx.load_from_string(_GRAPHS[np.dtype(dtype)]))


def test_the_row_copy_moves_one_row_to_another_address():
    rows = np.arange(24, dtype=np.float32).reshape(3, 8)
    RowCopy(np.dtype(np.float32), "cpu", ["CPUExecutionProvider"]).copy(
        rows.ctypes.data + 2 * rows[0].nbytes, rows.ctypes.data, 8
    )
    np.testing.assert_array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(rows[1], np.arange(8, 16))


def test_streams_past_what_reservation_holds_run_at_once_preempted_and_recomputed_to_the_text_they_get_alone(
    runtime,
):
    """Twelve streams of 20 + 150 tokens against 768 tokens (blocks of 64): charged their whole 170 tokens (192), four
    would run at once; charged as they grow, more run, the youngest are preempted as the others grow, and each
    stream's greedy text is the one it gets alone."""
    prompts = [[BOS_ID, *range(40 + i, 59 + i)] for i in range(12)]
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    engine = GenerationEngine(runtime, GenerationSettings(threads=1, kv_cache_tokens=768, max_running=16))
    try:

        async def alone() -> list[list[int]]:
            return [
                [t for e in [e async for e in engine.generate(GenerateRequest(p, params))] for t in e.token_ids]
                for p in prompts
            ]

        async def together() -> tuple[list[list[int]], int]:
            most = 0

            async def one(prompt: list[int]) -> list[int]:
                nonlocal most
                tokens = []
                async for event in engine.generate(GenerateRequest(prompt, params)):
                    tokens += event.token_ids
                    most = max(most, engine.state().running)
                return tokens

            return await asyncio.gather(*(one(p) for p in prompts)), most

        want = asyncio.run(alone())
        got, most = asyncio.run(together())
        state = engine.state()
    finally:
        engine.close()
    assert got == want
    assert state.preemptions > 0 and most >= 6, (state.preemptions, most)  # 1.5 x the 4 that reservation runs
    assert state.kv_budget_tokens == 768 and 768 // 192 == 4


def test_a_device_buffer_has_no_more_rows_than_the_budget_holds_whole_contexts(runtime):
    """On a GPU the buffer is allocated whole: its rows are max_running, or fewer where the KV budget holds fewer
    rows of the whole (page-rounded) context; on the host, max_running (its pages exist once written)."""
    gpu = dataclasses.replace(runtime, backend="gpu")
    settings = GenerationSettings(max_running=32, kv_cache_tokens=1000)
    assert slot_rows(gpu, settings, "cuda") == 1000 // 256 == 3  # the context, 200, in 256 columns
    assert slot_rows(gpu, dataclasses.replace(settings, kv_cache_tokens=100_000), "cuda") == 32
    assert slot_rows(runtime, settings, None) == 32
