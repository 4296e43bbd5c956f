"""The Open Inference Protocol's generate extension (KServe's generate_rest.yaml, Triton's): `text_input` and
`parameters` decoded into a GenerateRequest; `text_output` and `details.finish_reason` encoded from the token events,
whole (generate) or per event (generate_stream). The protocol's schema has no log-probabilities: `parameters.logprobs`
adds a `logprobs` list to each answer, in the shape of TGI's and KServe's token details. No torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.decoder_metadata import DecoderMetadata
from contract.tokenizer import NUM_SPECIAL, ByteTokenizer
from service.generate import ABORT, CANCELLED, EOS, LENGTH, STOP, GenerateRequest, TokenEvent
from service.generate.sampling import TokenLogprobs
from service.inference import MODEL_VERSION
from service.protocol.sampling_fields import DEFAULT, SamplingFields

FINISH = {STOP: "stop_sequence", EOS: "eos_token", LENGTH: "length", ABORT: "abort", CANCELLED: "abort"}


class GenerateParameters(SamplingFields):
    max_tokens: int = Field(
        DEFAULT.max_tokens, description="tokens to generate at most; prompt + max_tokens <= the context"
    )
    logprobs: int | None = Field(
        None,
        description="each generated token's log-probability and its N likeliest alternatives (0 to 20) in the "
        "answer's `logprobs`; null: none",
    )


class GenerateBody(BaseModel):
    """POST /v2/models/{name}/generate and generate_stream."""

    model_config = ConfigDict(extra="forbid")
    text_input: str = Field(description="the prompt (the byte tokenizer, BOS first)")
    parameters: GenerateParameters = GenerateParameters()
    id: str | None = Field(None, description="echoed")


def to_request(body: GenerateBody) -> GenerateRequest:
    p = body.parameters
    return GenerateRequest(body.text_input, p.sampling(p.max_tokens, p.logprobs))


def answer(
    name: str, body: GenerateBody, text: str, event: TokenEvent, logprobs: list[TokenLogprobs] | None = None
) -> dict[str, Any]:
    """The whole answer (text and `logprobs`: everything so far), or one stream event (text: its delta, logprobs:
    its tokens' when None); details on the last."""
    out: dict[str, Any] = {"model_name": name, "model_version": MODEL_VERSION, "text_output": text}
    if body.id is not None:
        out["id"] = body.id
    if body.parameters.logprobs is not None:
        out["logprobs"] = [token_logprob(t) for t in (event.logprobs if logprobs is None else logprobs)]
    if event.finish_reason is not None:
        usage = event.usage
        out["details"] = {
            "finish_reason": FINISH.get(event.finish_reason, event.finish_reason),
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "generated_tokens": usage.completion_tokens if usage else 0,
        }
    return out


def token_logprob(token: TokenLogprobs) -> dict[str, Any]:
    """One token's: its id, text (as the tokenizer decodes it alone), log-probability, whether it is special, and its
    alternatives, most likely first."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"id": token_id, "text": ByteTokenizer.token_text(token_id), "logprob": logprob}

    top = [one(*alternative) for alternative in token.top]
    return one(token.token, token.logprob) | {"special": token.token < NUM_SPECIAL, "top_logprobs": top}


class Alternative(BaseModel):
    id: int
    text: str
    logprob: float


class TokenLogprob(Alternative):
    special: bool
    top_logprobs: list[Alternative]


class GenerateDetails(BaseModel):
    finish_reason: str = Field(description="length, eos_token, stop_sequence or abort (the server stopped)")
    prompt_tokens: int
    generated_tokens: int


class GenerateResponse(BaseModel):
    """The generated text and why it ended; generate_stream: server-sent events of this shape, each with its text
    delta, `details` on the last."""

    model_name: str
    model_version: str
    text_output: str
    id: str | None = None
    logprobs: list[TokenLogprob] | None = Field(
        None, description="with parameters.logprobs: the tokens' (a stream: each event's)"
    )
    details: GenerateDetails | None = None


def decoder_metadata(meta: DecoderMetadata, platform: str) -> dict[str, Any]:
    """A decoder's v2 metadata (v2.model_metadata's, for a decoder): the generate extension's text_input and
    text_output, its head configuration and context length."""
    params = {k: getattr(meta, k) for k in ("heads", "kv_heads", "head_dim", "d_model", "layers", "vocab_size")}
    return {
        "name": meta.name,
        "versions": [MODEL_VERSION],
        "platform": platform,
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}],
        "parameters": {
            **params,
            "arch": meta.arch,
            "precision": meta.precision,
            "max_len": meta.max_len,
            "context_length": meta.max_len,
            "generate": "POST /v2/models/{name}/generate, /generate_stream; /openai/v1/completions",
        },
    }
