"""How one generation engine runs: its KV budget, running and waiting limits, queue timeout and ORT threads, with the
reasons for the defaults. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from contract.decoder_metadata import DecoderMetadata
from service.generate.kv_cache import COPIES, charged_width, token_bytes
from service.generate.scheduler import Limits
from service.generate.slot_cache import charge, page_tokens
from service.runtime import SPINNING

MIB = 2**20


@dataclass(frozen=True)
class GenerationSettings:
    # 128 MiB holds 8,192 tokens of the default decoder (d_model 512, 8 kv heads, 4 layers: 16 KiB a token) written in
    # place, 32 rows of 256 (max_running's); concatenated, 32 rows of a full 128-token context (twice: a step holds its
    # past and present). On 2 cores, past 32 rows a step buys little more throughput (and none past 64) while every
    # stream's tokens come further apart.
    kv_cache_mb: float = 128.0
    # The budget in tokens instead (it wins over kv_cache_mb when set); its bytes are a token's bytes x it (x COPIES
    # for a concatenated cache).
    kv_cache_tokens: int | None = None
    max_running: int = 32  # sequences in one decoding step whatever the budget: a step's batch size (see above)
    # Prompt tokens (rows x padded width) one step runs while other sequences decode: a longer prompt runs in chunks
    # over several steps, so that it delays each running stream's next token by one chunk's run, not its whole prompt.
    prefill_chunk: int = 256
    max_waiting: int = 256  # sequences queued for room; one more is a 503 at once (the classifiers' queue bound)
    queue_timeout_s: float = 30.0  # a queued sequence that has not started by then ends with a 503 (Retry-After)
    threads: int = 2  # ORT intra-op threads: one run at a time, so every core of a 2-core node
    backend: str = "auto"  # auto, cpu or gpu (service/runtime.py's provider choice)
    spinning: str = "run"  # ORT threads spin only during a run: steps follow each other, but the loop must not starve
    # The KV cache kept where the session runs between steps (ORT I/O binding), instead of crossing to the host and
    # back every step; None: on the GPU only (on the CPU the two are the same memory).
    io_binding: bool | None = None

    def __post_init__(self) -> None:
        problems = []
        for key in ("max_running", "prefill_chunk", "max_waiting", "threads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r} must be an integer >= 1")
        if self.kv_cache_tokens is not None and (
            isinstance(self.kv_cache_tokens, bool) or not isinstance(self.kv_cache_tokens, int)
        ):
            problems.append(f"kv_cache_tokens={self.kv_cache_tokens!r} must be an integer or None")
        for key in ("kv_cache_mb", "queue_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                problems.append(f"{key}={value!r} must be a number > 0")
        if self.spinning not in SPINNING:
            problems.append(f"spinning={self.spinning!r} is not one of {SPINNING}")
        if problems:
            raise ValueError("bad generation settings: " + "; ".join(problems))

    def kv_budget_tokens(self, meta: DecoderMetadata, itemsize: int = 4, block: int | None = None) -> int:
        """The budget in tokens for this model, whose cache holds `itemsize`-byte values (4: float32, 2: float16);
        ValueError when it cannot hold one full context (a request that fits the context must always be able to run,
        alone). kv_cache_mb bounds bytes: a cache written in place holds each sequence's own tokens (in whole
        `block`s; None: the host's pages, service/generate/slot_cache.py), a concatenated one COPIES rectangles of
        the batch (kv_cache.py), so it buys kv_cache_mb / (copies x bytes per token) tokens."""
        token = token_bytes(meta, np.dtype(f"f{itemsize}"))
        copies, block = _layout(meta, itemsize, block)
        least = charge(meta.max_len, block) if block else meta.max_len
        if self.kv_cache_tokens is not None:
            tokens, said = self.kv_cache_tokens, f"kv_cache_tokens={self.kv_cache_tokens}"
        else:
            tokens = int(self.kv_cache_mb * MIB // (copies * token))
            said = f"kv_cache_mb={self.kv_cache_mb:g} ({tokens} tokens at {copies} x {token} bytes a token)"
        if tokens < least:
            raise ValueError(
                f"model {meta.name!r}: {said} cannot hold one context of {meta.max_len} tokens; raise it to at least "
                f"{math.ceil(least * copies * token / MIB)} MiB or {least} tokens"
            )
        return tokens

    def rows_held(self, meta: DecoderMetadata, final_tokens: int, itemsize: int = 4) -> int:
        """How many sequences of `final_tokens` each (prompt + max_tokens) the budget runs at once (on the CPU)."""
        _, block = _layout(meta, itemsize, None)
        held = charge(final_tokens, block) if block else charged_width([final_tokens], meta.max_len)
        return self.kv_budget_tokens(meta, itemsize) // held

    def limits(self, meta: DecoderMetadata, itemsize: int = 4, block: int | None = None) -> Limits:
        """`block`: what a cache written in place charges a row in (None: the host's pages)."""
        tokens = self.kv_budget_tokens(meta, itemsize, block)
        copies, block = _layout(meta, itemsize, block)
        budget_bytes = copies * tokens * token_bytes(meta, np.dtype(f"f{itemsize}"))
        return Limits(
            tokens,
            meta.max_len,
            self.max_running,
            self.max_waiting,
            self.queue_timeout_s,
            budget_bytes,
            block,
            self.prefill_chunk,
        )


def _layout(meta: DecoderMetadata, itemsize: int, block: int | None) -> tuple[int, int]:
    """The copies of the batch a step holds and the block a row is charged in (0: a rectangle of rows x width)."""
    if not meta.cache_in_place:
        return COPIES, 0
    return 1, page_tokens(meta, np.dtype(f"f{itemsize}")) if block is None else block


def kv_cache_mb_for(meta: DecoderMetadata, rows: int, final_tokens: int, itemsize: int = 4) -> float:
    """The kv_cache_mb that runs `rows` sequences of `final_tokens` each (prompt + max_tokens) at once (on the CPU)."""
    copies, block = _layout(meta, itemsize, None)
    width = charge(final_tokens, block) if block else charged_width([final_tokens], meta.max_len)
    return copies * rows * width * token_bytes(meta, np.dtype(f"f{itemsize}")) / MIB
