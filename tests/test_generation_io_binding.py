"""The KV cache kept where the session runs between steps (ORT I/O binding, GenerationSettings.io_binding): on the
CPU the bound path runs too, and must generate what the plain one does for requests that join and leave a running
batch (each join and leave goes through the host); on a GPU (marked `gpu`) the engine binds by default and
generates the CPU's greedy tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import export_tiny_decoder

from service.generate import GenerateRequest, GenerationEngine, GenerationSettings, SamplingParams, TokenEvent

NAME = "lm-h4-kv2-d32"
PROMPTS = ["def f(x):", "The quick brown fox jumps over the lazy dog.", "x", "import os\n"]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("io-binding")
    export_tiny_decoder(out, 2, 256, seed=7)
    return out


def _requests() -> list[GenerateRequest]:
    """Unequal prompts and lengths: sequences join a running batch (wider and narrower prompts) and leave it."""
    greedy = [SamplingParams(max_tokens=90 - 20 * i, temperature=0, ignore_eos=True) for i in range(2)]
    sampled = [
        SamplingParams(max_tokens=70 - 20 * i, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(2)
    ]
    return [GenerateRequest(p, s) for p, s in zip(PROMPTS, [*greedy, *sampled], strict=True)]


async def _staggered(engine: GenerationEngine, requests: list[GenerateRequest]) -> list[list[TokenEvent]]:
    """Each request submitted once the one before has its first token, while it still runs."""
    streams, firsts = [], []
    for request in requests:
        stream = engine.submit(request)
        firsts.append(await anext(stream))
        streams.append(stream)

    async def rest(stream, first):
        return [first] + [event async for event in stream]

    return await asyncio.gather(*(rest(s, f) for s, f in zip(streams, firsts, strict=True)))


def _ids(events: list[list[TokenEvent]]) -> list[list[int]]:
    return [[i for e in per for i in e.token_ids] for per in events]


def test_the_bound_cache_generates_what_the_host_cache_does_as_sequences_join_and_leave(models_dir):
    plain = _generated(models_dir, backend="cpu", io_binding=False)
    bound = _generated(models_dir, backend="cpu", io_binding=True)
    assert [len(ids) for ids in bound] == [90, 70, 70, 50]
    assert bound == plain
    # prompts joining in chunks of 4 tokens: each chunk's past kept bound between its runs
    assert _generated(models_dir, backend="cpu", io_binding=True, prefill_chunk=4) == plain


@pytest.mark.gpu
def test_on_a_gpu_the_engine_binds_its_cache_and_generates_the_cpus_greedy_tokens(models_dir):
    engine = GenerationEngine.open(models_dir, NAME, GenerationSettings(threads=1, backend="gpu"))
    engine.close()
    assert engine.runtime.backend == "gpu", engine.runtime.reason
    gpu, cpu = _generated(models_dir, backend="gpu"), _generated(models_dir, backend="cpu")
    assert gpu[:2] == cpu[:2]  # the greedy ones (fp32 on both)


def _generated(models_dir: Path, **settings) -> list[list[int]]:
    engine = GenerationEngine.open(models_dir, NAME, GenerationSettings(threads=1, **settings))
    try:
        events = asyncio.run(asyncio.wait_for(_staggered(engine, _requests()), TIMEOUT_S))
    finally:
        engine.close()
    assert all(per[-1].finish_reason == "length" for per in events)
    return _ids(events)
