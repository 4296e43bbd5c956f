"""OpenAI's chat completions (`/openai/v1/chat/completions`): the messages rendered by the model's chat template into
one prompt (service/chat_template.py), then the same choices as a completion's (service/protocol/openai.py), answered
in the chat format: a message per choice, or a stream of deltas, with logprobs when asked. What is not built (tools,
penalties, logit_bias) is a 400 that says so. No torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.errors import BadRequestError
from service.generate import GenerateRequest
from service.generate.sampling import MAX_LOGPROBS
from service.protocol import openai
from service.protocol.logprobs import chat_logprobs
from service.protocol.sampling_fields import OpenAIFields


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A message of the conversation: its role and its text (a string, or text parts)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, description="accepted and not used")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(OpenAIFields):
    """POST /openai/v1/chat/completions: OpenAI's fields, and vLLM's `top_k` and `ignore_eos`."""

    model: str = Field(description="a decoder's name (GET /openai/v1/models) with a chat template")
    messages: list[Message] = Field(min_length=1, description="the conversation, rendered by the model's template")
    max_completion_tokens: int | None = Field(None, description="tokens to generate at most (max_tokens's new name)")
    max_tokens: int | None = Field(
        None, description="tokens to generate at most; when neither is given, what the context leaves after the prompt"
    )
    logprobs: bool | None = Field(False, description="each token's logprob (the model's, before temperature)")
    top_logprobs: int | None = Field(
        None, description=f"with logprobs: the 0 to {MAX_LOGPROBS} likeliest alternatives of each token"
    )


def as_completion(body: ChatCompletionRequest, prompt: str) -> openai.CompletionRequest:
    """The completion the chat asks for, of the rendered `prompt`: one request path from here on."""
    unsupported = body.unsupported()
    if unsupported:
        raise BadRequestError(f"not supported: {', '.join(unsupported)} (no penalties or logit_bias)")
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequestError("top_logprobs needs logprobs: true")
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise BadRequestError("give max_completion_tokens or max_tokens (its old name), not two different values")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    fields = ("temperature", "top_p", "top_k", "seed", "stop", "n", "ignore_eos")
    chosen = {name: getattr(body, name) for name in fields}
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return openai.CompletionRequest(
        model=body.model,
        prompt=prompt,
        max_tokens=max_tokens,
        logprobs=logprobs,
        **chosen,
    )


def to_requests(body: ChatCompletionRequest, prompt: str) -> list[GenerateRequest]:
    """The engine's requests for the rendered `prompt`: a completion's, generating until the context ends unless a
    max is given (OpenAI's chat default)."""
    given = body.max_completion_tokens is not None or body.max_tokens is not None
    return openai.to_requests(as_completion(body, prompt), until_context=not given)


def messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as a chat template takes them."""
    return [{"role": m.role, "content": m.text()} for m in body.messages]


class ChatCompletion(openai.Completion):
    """A chat completion's identity and usage, its choices as messages, or as deltas (the first of each choice with
    its role)."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, n: int = 1, logprobs: bool = False) -> None:
        super().__init__(model, n, logprobs)
        self._started: set[int] = set()
        self.logprobs_format = chat_logprobs

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ChatCompletion:  # type: ignore[override]
        return cls(body.model, 1 if body.n is None else body.n, bool(body.logprobs))

    def _content(self, index: int, text: str, chunk: bool) -> dict[str, Any]:
        if not chunk:
            return {"message": {"role": "assistant", "content": text}}
        if index in self._started:
            return {"delta": {"content": text}}
        self._started.add(index)
        return {"delta": {"role": "assistant", "content": text}}


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Each token of the message (`bytes:\\xNN` for a byte that is part of a character, its bytes as they are)."""

    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A chat completion (`stream: false`), a choice per `n`; with `stream: true`, server-sent events of
    `chat.completion.chunk`s whose choices carry a `delta` (the first of each choice with its `role`) in place of
    `message` (`usage` null, and in a last chunk of its own only when `stream_options.include_usage` asks), then
    `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: openai.Usage | None
