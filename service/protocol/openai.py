"""OpenAI's completions wire format (`/openai/v1`, as KServe's OpenAI data plane): the request decoded into
GenerateRequests, one per choice (each prompt of a batch, `n` times), and the answer, whole or as stream chunks,
encoded from their token events, with logprobs and the echoed prompt when asked. What is not built (best_of, suffix,
penalties, logit_bias) is a 400 that says so. No torch.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt

from contract.decoder_metadata import DecoderMetadata
from service.errors import BadRequestError
from service.generate import OPENAI_FINISH_REASONS, GenerateRequest, TokenEvent
from service.generate.sampling import MAX_LOGPROBS
from service.inference import ModelStatus
from service.protocol.logprobs import ChoiceLogprobs, completion_logprobs
from service.protocol.sampling_fields import DEFAULT, MAX_N, OpenAIFields

# Why a sequence ended, as OpenAI says it: "stop" for a stop string or EOS, "length" at max_tokens; vLLM's "abort".
FINISH = OPENAI_FINISH_REASONS
MAX_CHOICES = 64  # choices of one request, every prompt's together: each is a sequence in the engine


class CompletionRequest(OpenAIFields):
    """POST /openai/v1/completions: OpenAI's fields, and vLLM's `top_k` and `ignore_eos`."""

    model: str = Field(description="a decoder's name (GET /openai/v1/models)")
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="text (the byte tokenizer, BOS first) or token ids as they are; a list of either is a batch: "
        "n choices each, numbered prompt x n + choice"
    )
    max_tokens: int | None = Field(
        DEFAULT.max_tokens, description="tokens to generate at most; prompt + max_tokens <= the context"
    )
    best_of: int | None = Field(None, description="null, 1 or n only")
    logprobs: int | None = Field(
        None,
        description=f"each token's logprob and its 0 to {MAX_LOGPROBS} likeliest alternatives (the model's, before "
        "temperature, top_k or top_p); null: none",
    )
    echo: bool | None = Field(
        False,
        description="the prompt's text (and with logprobs its tokens') before the completion's; max_tokens 0 "
        "gives the prompt's alone",
    )
    suffix: str | None = Field(None, description="null only: not built")


def _unsupported(body: CompletionRequest) -> list[str]:
    given = [("best_of", body.best_of not in (None, 1, body.n)), ("suffix", bool(body.suffix))]
    return [f"{name}={getattr(body, name)!r}" for name, bad in given if bad] + body.unsupported()


def prompts(body: CompletionRequest) -> list[str | tuple[int, ...]]:
    """The request's prompts: one, or a batch's (a list of strings, or of token-id lists)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("prompt is an empty list: give text, token ids, or a list of either")
    if isinstance(prompt[0], int):
        return [tuple(prompt)]
    return [p if isinstance(p, str) else tuple(p) for p in prompt]


def choices(body: CompletionRequest) -> int:
    """`n`: choices per prompt."""
    return 1 if body.n is None else body.n


def to_requests(body: CompletionRequest, until_context: bool = False) -> list[GenerateRequest]:
    """The engine's requests, choice j of prompt i at index i x n + j; BadRequestError (400) for what is not
    supported or out of bounds, SamplingParamsError for bad values. The engine's checks of a batch's prompt name it.
    `until_context`: max_tokens is what the model's context leaves after each prompt (a chat's default)."""
    unsupported = _unsupported(body)
    if unsupported:
        raise BadRequestError(f"not supported: {', '.join(unsupported)} (no best_of or suffix)")
    n, batch = choices(body), prompts(body)
    if isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise BadRequestError(f"n={body.n!r} must be 1 to {MAX_N}")
    if len(batch) * n > MAX_CHOICES:
        raise BadRequestError(f"{len(batch)} prompts x n={n} is {len(batch) * n} choices, over {MAX_CHOICES} a request")
    prompt_logprobs = (body.logprobs or 0) if body.echo else None  # the echoed text comes from the prompt's tokens
    params = body.sampling(body.max_tokens, body.logprobs, prompt_logprobs)
    requests = []
    for i, prompt in enumerate(batch):
        label = f"prompt {i}" if len(batch) > 1 else ""
        for j in range(n):
            choice = params if j == 0 or params.seed is None else replace(params, seed=child_seed(params.seed, j))
            requests.append(GenerateRequest(prompt, choice, label=label, until_context=until_context))
    return requests


def child_seed(seed: int, j: int) -> int:
    """Choice j's seed, drawn from `seed` and j alone (never the batch or the order of arrival)."""
    return int(np.random.SeedSequence([seed, j]).generate_state(1, np.uint64)[0])


class Completion:
    """One completion's identity, shared by its chunks, and the usage of its choices so far: each prompt's tokens
    once, every choice's generated tokens. A choice's text is its `text` here; a subclass says it otherwise
    (`_content`)."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, n: int = 1, logprobs: bool = False, echo: bool = False) -> None:
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self._n = n
        self._prompt = self._completion = 0
        self._logprobs, self._echo = logprobs, echo
        self._choices: dict[int, ChoiceLogprobs] = {}  # by index, when logprobs or echo are asked
        self._echoed: dict[int, str] = {}  # each choice's prompt text, with echo
        self.logprobs_format = completion_logprobs

    @classmethod
    def of(cls, body: CompletionRequest) -> Completion:
        return cls(body.model, choices(body), body.logprobs is not None, bool(body.echo))

    def take(self, index: int, event: TokenEvent) -> tuple[str, dict[str, list[Any]] | None]:
        """Choice `index`'s event seen: the echoed prompt's text it brings, and its logprobs (None: not asked)."""
        if not (self._logprobs or self._echo):
            return "", None
        echoed, entries = self._choices.setdefault(index, ChoiceLogprobs(self._echo)).take(event)
        if echoed:
            self._echoed[index] = echoed
        return echoed, (self.logprobs_format(entries) if self._logprobs else None)

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, int] | None, chunk: bool = False) -> dict:
        kind = self.chunk_object if chunk else self.object
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return out | {"choices": choices, "usage": usage}

    def ended(self, index: int, last: TokenEvent) -> None:
        """Choice `index` ended with `last` (its usage counted)."""
        if last.usage is not None:
            self._prompt += last.usage.prompt_tokens if index % self._n == 0 else 0
            self._completion += last.usage.completion_tokens

    def whole(self, texts: dict[int, str], lasts: dict[int, TokenEvent]) -> dict[str, Any]:
        """Every choice's text and last event, by index (each of its events `take`n)."""
        for index, last in lasts.items():
            self.ended(index, last)
        choices = []
        for i in sorted(texts):
            text, seen = self._echoed.get(i, "") + texts[i], self._choices.get(i)
            logprobs = self.logprobs_format(seen.entries) if seen is not None and self._logprobs else None
            choices.append(self._choice(i, text, lasts[i].finish_reason, False, logprobs))
        return self._envelope(choices, self.usage())

    def chunk(self, index: int, event: TokenEvent) -> dict[str, Any]:
        """A stream chunk: choice `index`'s text delta (after the echoed prompt's, on its first) and its tokens'
        logprobs; its last has the finish_reason."""
        if event.finish_reason is not None:
            self.ended(index, event)
        echoed, entries = self.take(index, event)
        choice = self._choice(index, echoed + event.text, event.finish_reason, True, entries)
        return self._envelope([choice], None, chunk=True)

    def _choice(
        self, index: int, text: str, finish_reason: str | None, chunk: bool, logprobs: dict | None = None
    ) -> dict[str, Any]:
        reason = None if finish_reason is None else FINISH.get(finish_reason, finish_reason)
        return {"index": index, **self._content(index, text, chunk), "logprobs": logprobs, "finish_reason": reason}

    def _content(self, index: int, text: str, chunk: bool) -> dict[str, Any]:
        """Choice `index`'s `text` (whole, or a `chunk`'s delta) as the answer's format writes it."""
        return {"text": text}

    def usage_chunk(self) -> dict[str, Any]:
        """The stream's last chunk when `stream_options.include_usage` asks: no choices, the usage."""
        return self._envelope([], self.usage(), chunk=True)

    def usage(self) -> dict[str, int]:
        prompt, completion = self._prompt, self._completion
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def model_entry(status: ModelStatus) -> dict[str, Any] | None:
    """A ready decoder as OpenAI's model object (with its context length and heads); None for anything else."""
    meta = status.metadata
    if not (status.ready and isinstance(meta, DecoderMetadata)):
        return None
    entry = {"id": status.name, "object": "model", "created": 0, "owned_by": "mha-serving"}
    return entry | {"max_model_len": meta.max_len, "heads": meta.heads, "kv_heads": meta.kv_heads}


def model_list(statuses: list[ModelStatus]) -> dict[str, Any]:
    """GET /openai/v1/models: the ready decoders, in OpenAI's list format."""
    return {"object": "list", "data": [entry for status in statuses if (entry := model_entry(status)) is not None]}


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    heads: int
    kv_heads: int


class ModelList(BaseModel):
    """The decoders served (OpenAI's list format)."""

    object: Literal["list"]
    data: list[Model]


class Logprobs(BaseModel):
    """A choice's tokens (`bytes:\\xNN` for a byte that is part of a character), the logprob of each (null for an
    echoed prompt's first), its likeliest alternatives by token, and where each begins in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    text: str
    index: int
    logprobs: Logprobs | None = None
    finish_reason: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A completion (`stream: false`), a choice per prompt and `n`; with `stream: true`, server-sent events of chunks
    of this shape, each with one choice's text delta and its index (`usage` null, and in a last chunk of its own,
    with no choices, only when `stream_options.include_usage` asks), then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None
