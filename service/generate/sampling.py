"""Sampling: a request's sampling parameters (validated) and the choice of the next token of each sequence of a batch,
each from its own seeded generator, so a seed gives the same text alone or batched with others. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from service.errors import SamplingParamsError

MAX_STOPS = 16  # stop strings per request: each is searched for after every token
MAX_STOP_CHARS = 256  # characters per stop string: the text held back can be this long less one
SEED_LIMIT = 2**64  # numpy's generators take any non-negative integer; this is what the wire formats carry
MAX_LOGPROBS = 20  # the most likely alternatives a token's logprobs may list (vLLM's default bound)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens; every bad value raises SamplingParamsError (a 400) naming it."""

    max_tokens: int = 16  # tokens to generate at most (OpenAI's default for completions)
    temperature: float = 1.0  # 0: greedy (argmax), no generator drawn from
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the fewest tokens whose probabilities add up to top_p; 1: all
    seed: int | None = None  # None: a fresh random generator for this request
    stop: tuple[str, ...] = ()  # the text ends before the first of these (found across tokens; never returned)
    ignore_eos: bool = False  # go on past EOS up to max_tokens (vLLM's option, for benchmarks)
    # each generated token's log-probability and its `logprobs` likeliest alternatives (0: none), from the model's
    # distribution before temperature, top-k or top-p (as vLLM's); None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (OpenAI's echo); None: none

    def __post_init__(self) -> None:
        # null (none), a lone string or a list from JSON: one spelling, a tuple. A lone "" is kept, to be refused as
        # [""] is: a wire format must pass `stop` as it came (None for none), never `stop or ()`.
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str | list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        problems = [p for p in (self._number_problem(), self._stop_problem()) if p]
        if problems:
            raise SamplingParamsError("bad sampling parameters: " + "; ".join(problems))

    def _number_problem(self) -> str:
        if not _is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            return f"max_tokens={self.max_tokens!r} must be an integer >= 1 (0: the prompt's logprobs only, with echo)"
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                return f"{key}={value!r} must be an integer from 0 to {MAX_LOGPROBS}"
        if not _is_number(self.temperature) or self.temperature < 0:
            return f"temperature={self.temperature!r} must be a number >= 0 (0: greedy)"
        if not _is_int(self.top_k) or self.top_k < 0:
            return f"top_k={self.top_k!r} must be an integer >= 0 (0: all tokens)"
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p={self.top_p!r} must be a number in (0, 1]"
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            return f"seed={self.seed!r} must be an integer in [0, 2**64) or null"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos={self.ignore_eos!r} must be true or false"
        return ""

    def _stop_problem(self) -> str:
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            return f"stop={self.stop!r} must be a string or a list of strings"
        if len(self.stop) > MAX_STOPS:
            return f"stop has {len(self.stop)} strings, at most {MAX_STOPS} are allowed"
        for s in self.stop:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                return f"stop string {s[:40]!r} has {len(s)} characters, it must have 1 to {MAX_STOP_CHARS}"
        return ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> np.random.Generator:
        """This request's own generator: never shared, so its draws do not depend on what else runs."""
        return np.random.default_rng(self.seed)


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability under the model, and the likeliest tokens' (id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: np.ndarray, tokens: np.ndarray, top: int) -> list[TokenLogprobs]:
    """(n, V) logits and (n,) the tokens that followed -> each token's log-softmax value and the `top` likeliest."""
    scores = logits.astype(np.float64)
    peak = scores.max(axis=-1, keepdims=True)  # (n, 1)
    logp = scores - peak - np.log(np.exp(scores - peak).sum(axis=-1, keepdims=True))  # (n, V)
    chosen = logp[np.arange(len(tokens)), tokens]  # (n,)
    if top:
        best = np.argpartition(-logp, top - 1, axis=-1)[:, :top]  # (n, top), unordered: no full sort per row
        order = np.argsort(-np.take_along_axis(logp, best, axis=-1), axis=-1, kind="stable")
        best = np.take_along_axis(best, order, axis=-1)  # (n, top), most likely first
    rows = []
    for row, token in enumerate(tokens.tolist()):
        alternatives = tuple((int(i), float(logp[row, i])) for i in best[row]) if top else ()
        rows.append(TokenLogprobs(token, float(chosen[row]), alternatives))
    return rows


def sample(logits: np.ndarray, params: list[SamplingParams], generators: list[np.random.Generator]) -> np.ndarray:
    """(n, V) float32 logits of each sequence's last position -> (n,) int64 next tokens, row i chosen by params[i]
    with generators[i] (one draw per sampled token, none for a greedy row)."""
    tokens = logits.argmax(axis=-1)  # (n,): the greedy rows' answer, computed for all in one call
    for row, (p, rng) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, rng)
    return tokens.astype(np.int64, copy=False)


def _sample_row(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """nanoGPT's recipe for one (V,) row: temperature, top-k, softmax, then top-p, then one uniform draw."""
    # The max subtracted before dividing: every value is then <= 0 and the most likely token's is 0, so a temperature
    # as small as 5e-324 sends the others to -inf (probability 0), never to inf - inf = NaN; that is greedy.
    scaled = logits.astype(np.float64)
    scaled = (scaled - scaled.max()) / p.temperature
    order = np.argsort(-scaled, kind="stable")  # (V,) token ids, most likely first; stable: ties in id order
    ranked = scaled[order]
    if 0 < p.top_k < ranked.size:
        ranked = ranked[: p.top_k]
    probs = np.exp(ranked - ranked[0])
    probs /= probs.sum()
    if p.top_p < 1.0:
        before = np.cumsum(probs) - probs  # the mass of the more likely tokens: the first token is always kept
        probs = probs[before < p.top_p]
        probs /= probs.sum()
    # Inverse CDF with exactly one draw: the generator advances the same whatever the batch or the vocabulary cut.
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(order[min(index, probs.size - 1)])
