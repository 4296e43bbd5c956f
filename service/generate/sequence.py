"""One request's state inside the engine, from submission to its last event, and where its events go (a queue on
its consumer's event loop). No torch."""

from __future__ import annotations

import asyncio
import itertools
import time

from service.generate.output import TextOutput
from service.generate.request import Timing, TokenEvent, Usage
from service.generate.sampling import SamplingParams

_ids = itertools.count()


class Sequence:
    """Mutable, as vLLM's Request is: the engine's thread advances it; `stop_reason` may be set from any thread
    (one attribute write), and the scheduler's next step acts on it."""

    __slots__ = (
        "arrived",
        "first_token",
        "id",
        "loop",
        "next_input",
        "output",
        "params",
        "prompt",
        "rng",
        "sink",
        "started",
        "stop_reason",
    )

    def __init__(
        self, prompt: tuple[int, ...], params: SamplingParams, output: TextOutput, sink: asyncio.Queue
    ) -> None:
        self.id = next(_ids)
        self.prompt, self.params, self.output = prompt, params, output
        self.rng = params.generator()  # its own: the draws do not depend on what else is batched with it
        self.arrived = time.perf_counter()
        self.started = 0.0  # when its prefill started
        self.first_token = 0.0  # when its first token's event was made
        self.next_input = -1  # the last token generated: the input of its next decoding step
        self.stop_reason: str | None = None  # CANCELLED or ABORT, asked for from outside the engine's thread
        self.loop = asyncio.get_running_loop()
        self.sink = sink  # filled on `loop`'s thread only

    @property
    def kv_tokens(self) -> int:
        """What it reserves in the KV budget at admission: its whole context, prompt and max_tokens."""
        return len(self.prompt) + self.params.max_tokens

    def usage(self) -> Usage:
        return Usage(len(self.prompt), self.output.tokens)

    def event(self, step: int, tokens: tuple[int, ...], text: str, now: float, finish: str | None = None) -> TokenEvent:
        """Its next event, made on the engine's thread at the end of a step; the last one (a finish_reason) carries
        usage and timing."""
        # the queue time goes out on the first event, so that it is known of a stream its consumer leaves early
        starts = bool(tokens) and not self.first_token
        if starts:
            self.first_token = now
        queued_s = self.started - self.arrived if starts else None
        if finish is None:
            return TokenEvent(tokens, text, now, step, queued_s=queued_s)
        queued = self.started - self.arrived if self.started else 0.0
        first = self.first_token - self.arrived if self.first_token else 0.0
        timing = Timing(self.arrived, queued, first, now - self.arrived)
        return TokenEvent(tokens, text, now, step, finish, self.usage(), timing, queued_s)
