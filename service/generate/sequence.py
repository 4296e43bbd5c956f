"""One request's state inside the engine, from submission to its last event, and where its events go (a queue on
its consumer's event loop). No torch."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import TYPE_CHECKING

from service.generate.output import TextOutput
from service.generate.request import Timing, TokenEvent, Usage
from service.generate.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from service.generate.stream import TokenStream

_ids = itertools.count()


class Sequence:
    """Mutable, as vLLM's Request is: the engine's thread advances it; `stop_reason` may be set from any thread
    (one attribute write), and the scheduler's next step acts on it."""

    __slots__ = (
        "arrived",
        "first_token",
        "generated",
        "id",
        "logprobs",
        "loop",
        "next_input",
        "output",
        "params",
        "pending",
        "prompt",
        "prompt_logprobs",
        "prompt_sent",
        "rng",
        "sink",
        "started",
        "stop_reason",
        "unsent",
    )

    def __init__(
        self,
        prompt: tuple[int, ...],
        params: SamplingParams,
        output: TextOutput,
        arrived: float | None = None,
    ) -> None:
        self.id = next(_ids)
        self.prompt, self.params, self.output = prompt, params, output
        self.rng = params.generator()  # its own: the draws do not depend on what else is batched with it
        self.arrived = time.perf_counter() if arrived is None else arrived  # the request's head, in this process
        self.started = 0.0  # when its prefill started
        self.first_token = 0.0  # when its first token's event was made
        self.next_input = -1  # the last token generated: the input of its next decoding step
        self.pending = 0  # context tokens still to run before it decodes (the scheduler's, counted at admission)
        self.generated: list[int] = []  # its tokens so far: with the prompt, what a resumed sequence recomputes
        self.logprobs: TokenLogprobs | None = None  # its last token's, when its params ask (set by the sampling)
        # its prompt tokens' (the first's NaN: nothing comes before it), filled as its prompt's chunks run (when its
        # params ask), sent once
        self.prompt_logprobs = [TokenLogprobs(prompt[0], math.nan)] if params.prompt_logprobs is not None else []
        self.prompt_sent = params.prompt_logprobs is None
        self.stop_reason: str | None = None  # CANCELLED or ABORT, asked for from outside the engine's thread
        self.loop = asyncio.get_running_loop()
        self.sink: TokenStream | None = None  # its consumer's stream (which sets it), fed on `loop`'s thread only
        self.unsent = 0  # bytes of its events in `sink`, not taken by its consumer yet (`loop`'s thread only)

    @property
    def kv_tokens(self) -> int:
        """The longest its row can grow: prompt and max_tokens (the width the scheduler charges for it)."""
        return len(self.prompt) + self.params.max_tokens

    @property
    def length(self) -> int:
        """Its tokens so far, prompt and generated: what its row holds once its next step has run."""
        return len(self.prompt) + len(self.generated)

    @property
    def context(self) -> tuple[int, ...]:
        """What its prefill runs: the prompt, and the tokens so far of a sequence resumed after a pause."""
        return self.prompt + tuple(self.generated) if self.generated else self.prompt

    def usage(self) -> Usage:
        return Usage(len(self.prompt), self.output.tokens)

    def event(self, step: int, tokens: tuple[int, ...], text: str, now: float, finish: str | None = None) -> TokenEvent:
        """Its next event, made on the engine's thread at the end of a step; the last one (a finish_reason) carries
        usage and timing; a token's logprobs and, once, the prompt's go with the tokens, when its params ask."""
        # the queue time goes out on the first event, so that it is known of a stream its consumer leaves early
        starts = bool(tokens) and not self.first_token
        if starts:
            self.first_token = now
        queued_s = self.started - self.arrived if starts else None
        logprobs = (self.logprobs,) if tokens and self.logprobs is not None else ()
        prompt = None
        if not self.prompt_sent and (tokens or finish is not None):
            prompt, self.prompt_sent = tuple(self.prompt_logprobs), True
        if finish is None:
            return TokenEvent(tokens, text, now, step, queued_s=queued_s, logprobs=logprobs, prompt_logprobs=prompt)
        queued = self.started - self.arrived if self.started else 0.0
        first = self.first_token - self.arrived if self.first_token else 0.0
        timing = Timing(self.arrived, queued, first, now - self.arrived)
        return TokenEvent(tokens, text, now, step, finish, self.usage(), timing, queued_s, logprobs, prompt)
