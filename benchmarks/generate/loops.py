"""The in-process references: (a) a bare greedy loop of the decoder's graph on a fixed batch (prefill all rows at
once, then one token per step for every row, present fed back as past: what batched decoding can do at best for that
batch), and (b) ONNX Runtime GenAI on the same folder, one generator per request, generators side by side on threads
(how its CPU path serves concurrent requests). Also the step loop the plain server runs for one request. No torch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np

from benchmarks.generate.figures import Timed, figures
from contract.decoder_metadata import POSITION_IDS
from contract.metadata import ATTENTION_MASK, INPUT_IDS
from service.generate.runner import cache_device, run_step
from service.generate.session import DecoderRuntime
from service.generate.slot_cache import SlotCache
from service.generate.slot_runner import run_in_place, slot_device


def greedy_steps(
    runtime: DecoderRuntime, prompts: np.ndarray, new: int, bound: bool | None = None
) -> Iterator[np.ndarray]:
    """Each step's greedy tokens (B,) for `prompts` (B, T) of one length: one prefill, then new - 1 decoding steps
    of one token per row with the last step's present as past. `bound` (None: on the GPU only): present stays where
    the session runs between steps (ORT I/O binding), as the service keeps its KV cache on a GPU. A graph that writes
    its cache in place has it written in place here too."""
    if runtime.meta.cache_in_place:
        yield from _in_place_steps(runtime, prompts, new, bound)
        return
    meta, session = runtime.meta, runtime.session
    device = cache_device(runtime, bound)
    batch, total = prompts.shape
    empty = np.zeros((batch, meta.kv_heads, 0, meta.head_dim), runtime.cache_dtype)  # (B, kv, 0, hs)
    past: dict = dict.fromkeys(meta.input_names[3:], empty)
    ids = prompts
    for _ in range(new):
        positions = np.tile(np.arange(total - ids.shape[1], total, dtype=np.int64), (batch, 1))  # (B, T or 1)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: np.ones((batch, total), np.int64), POSITION_IDS: positions}
        # logits (B, T or 1, V); present (B, kv, total, hs) per layer, the next step's past
        logits, present = run_step(session, meta.output_names, {**feeds, **past}, device)
        past = dict(zip(past, present, strict=True))
        tokens = logits[:, -1].argmax(axis=-1)  # (B,)
        yield tokens
        ids, total = tokens[:, None].astype(np.int64), total + 1  # (B, 1)


def _in_place_steps(runtime: DecoderRuntime, prompts: np.ndarray, new: int, bound: bool | None) -> Iterator[np.ndarray]:
    """greedy_steps with the rows of one buffer bound as past and present (service/generate/slot_cache.py)."""
    meta, (batch, total) = runtime.meta, prompts.shape
    device = slot_device(runtime, bound)
    providers = runtime.session.get_providers()
    cache = SlotCache(meta, np.dtype(runtime.cache_dtype), batch, device, providers)
    cache.add([total] * batch)
    feeds = SlotCache.prefill_feeds([tuple(row) for row in prompts.tolist()], meta.pad_id)  # (B, T), no padding
    for step in range(new):
        logits = run_in_place(runtime.session, meta.output_names[0], cache, feeds, 0, batch)  # (B, T or 1, V)
        if step:
            cache.advance(batch)
        tokens = logits[:, -1].argmax(axis=-1)  # (B,)
        yield tokens
        feeds = cache.decode_feeds(tokens.astype(np.int64))


def bare_loop(runtime: DecoderRuntime, prompts: np.ndarray, new: int, repeats: int) -> dict:
    """`repeats` batches of every row of `prompts` (B, T) back to back; each row's tokens timed as the step that
    made them ended (prefill: its time to first token; each step after: its time per token)."""
    timed: list[Timed] = []
    start = time.perf_counter()
    for _ in range(repeats):
        rows = [Timed(time.perf_counter()) for _ in range(len(prompts))]
        for _ in greedy_steps(runtime, prompts, new):
            now = time.perf_counter()
            for row in rows:
                row.token_times.append(now)
        timed += rows
    return figures(timed, time.perf_counter() - start)


def genai_model(folder: str):
    """The folder as exported (its genai_config.json), loaded once for every generator."""
    import onnxruntime_genai as og  # only this side needs it: the benchmark runs without it (`--systems`)

    return og.Model(folder)


def genai(model, prompts: np.ndarray, new: int, repeats: int) -> dict:
    """One thread per row of `prompts` (B, T), each generating `repeats` requests one after the other, each with a
    generator of its own; min_length holds EOS off, as the served requests' ignore_eos does."""
    import onnxruntime_genai as og

    length = prompts.shape[1] + new
    timed: list[list[Timed]] = [[] for _ in prompts]

    def requests(row: int) -> None:
        # Sent when the measurement starts, then as the last one ends: a thread's wait for the GIL or ORT's threads
        # counts in its time to first token, as a queued request's wait does in the service's.
        sent = start
        for _ in range(repeats):
            one = Timed(sent)
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=length, min_length=length, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(prompts[row : row + 1].astype(np.int32))  # (1, T)
            while not generator.is_done():
                generator.generate_next_token()
                one.token_times.append(time.perf_counter())
            timed[row].append(one)
            sent = one.token_times[-1]

    threads = [threading.Thread(target=requests, args=(row,)) for row in range(len(prompts))]
    start = time.perf_counter()  # read by the threads
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return figures([t for row in timed for t in row], time.perf_counter() - start)
