"""OpenAI's completions wire format (`/openai/v1`, as KServe's OpenAI data plane): the request decoded into a
GenerateRequest, and the answer, whole or as stream chunks, encoded from the token events. What is not built (n > 1,
best_of, logprobs, echo, suffix, penalties, logit_bias) is a 400 that says so. No torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from contract.decoder_metadata import DecoderMetadata
from service.errors import BadRequestError
from service.generate import OPENAI_FINISH_REASONS, GenerateRequest, SamplingParams, TokenEvent
from service.inference import ModelStatus

# Why a sequence ended, as OpenAI says it: "stop" for a stop string or EOS, "length" at max_tokens; vLLM's "abort".
FINISH = OPENAI_FINISH_REASONS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="a last chunk with no choices and the usage")


class CompletionRequest(BaseModel):
    """POST /openai/v1/completions: OpenAI's fields, and vLLM's `top_k` and `ignore_eos`."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="a decoder's name (GET /openai/v1/models)")
    prompt: str | list[StrictInt] = Field(description="text (the byte tokenizer, BOS first) or token ids as they are")
    max_tokens: int | None = Field(16, description="tokens to generate at most; prompt + max_tokens <= the context")
    temperature: float | None = Field(1.0, description="0: greedy")
    top_p: float | None = Field(1.0, description="nucleus sampling: (0, 1]")
    top_k: int | None = Field(None, description="the k most likely tokens only (vLLM's); 0 or null: all")
    seed: int | None = Field(None, description="the same seed gives the same text, alone or batched with others")
    stop: str | list[str] | None = Field(None, description="up to 16 strings; the text ends before the first found")
    stream: bool = Field(False, description="server-sent events: a chunk per text delta, then `data: [DONE]`")
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="go on past EOS up to max_tokens (vLLM's, for benchmarks)")
    user: str | None = Field(None, description="accepted and not used")
    n: int | None = Field(1, description="1 only")
    best_of: int | None = Field(None, description="1 or null only")
    logprobs: int | None = Field(None, description="null only: not built")
    echo: bool | None = Field(False, description="false only: not built")
    suffix: str | None = Field(None, description="null only: not built")
    presence_penalty: float | None = Field(0.0, description="0 only: not built")
    frequency_penalty: float | None = Field(0.0, description="0 only: not built")
    logit_bias: dict[str, float] | None = Field(None, description="null or {} only: not built")


def _unsupported(body: CompletionRequest) -> list[str]:
    given = [
        ("n", body.n not in (None, 1)),
        ("best_of", body.best_of not in (None, 1)),
        ("logprobs", body.logprobs is not None),
        ("echo", bool(body.echo)),
        ("suffix", bool(body.suffix)),
        ("presence_penalty", body.presence_penalty not in (None, 0)),
        ("frequency_penalty", body.frequency_penalty not in (None, 0)),
        ("logit_bias", bool(body.logit_bias)),
    ]
    return [f"{name}={getattr(body, name)!r}" for name, bad in given if bad]


def to_request(body: CompletionRequest) -> GenerateRequest:
    """The engine's request; BadRequestError (400) for what is not supported, SamplingParamsError for bad values."""
    unsupported = _unsupported(body)
    if unsupported:
        raise BadRequestError(f"not supported: {', '.join(unsupported)} (one choice, no logprobs, echo or suffix)")
    params = SamplingParams(
        max_tokens=16 if body.max_tokens is None else body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
    )
    return GenerateRequest(body.prompt if isinstance(body.prompt, str) else tuple(body.prompt), params)


class Completion:
    """One completion's identity, shared by its chunks."""

    def __init__(self, model: str) -> None:
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}
        return out | {"choices": choices, "usage": usage}

    def whole(self, text: str, last: TokenEvent) -> dict[str, Any]:
        return self._envelope([_choice(text, last.finish_reason)], usage(last))

    def chunk(self, event: TokenEvent, with_usage: bool) -> dict[str, Any]:
        """A stream chunk: the event's text delta; the last one has the finish_reason (and the usage unless a
        separate usage chunk was asked for)."""
        last = event.finish_reason is not None
        return self._envelope([_choice(event.text, event.finish_reason)], usage(event) if last and with_usage else None)

    def usage_chunk(self, last: TokenEvent) -> dict[str, Any]:
        return self._envelope([], usage(last))


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    reason = None if finish_reason is None else FINISH.get(finish_reason, finish_reason)
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}


def usage(event: TokenEvent) -> dict[str, int] | None:
    if event.usage is None:
        return None
    prompt, completion = event.usage.prompt_tokens, event.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def model_list(statuses: list[ModelStatus]) -> dict[str, Any]:
    """GET /openai/v1/models: the ready decoders, in OpenAI's list format (with their context length)."""
    data = []
    for status in statuses:
        meta = status.metadata
        if status.ready and isinstance(meta, DecoderMetadata):
            entry = {"id": status.name, "object": "model", "created": 0, "owned_by": "mha-serving"}
            data.append(entry | {"max_model_len": meta.max_len, "heads": meta.heads, "kv_heads": meta.kv_heads})
    return {"object": "list", "data": data}


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


class Choice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A completion (`stream: false`); with `stream: true`, server-sent events of chunks of this shape (`usage` on
    the last, or in a chunk of its own with `stream_options.include_usage`), then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None
