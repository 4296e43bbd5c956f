"""The sampling fields every generation route takes (OpenAI's completions and chat, the Open Inference Protocol's
generate and so gRPC's ModelGenerate), described once with SamplingParams' defaults; null is the default. OpenAI's
routes share the fields of their own on top (`n`, streams, the penalties that are not built). No torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service.generate import SamplingParams
from service.generate.sampling import MAX_STOPS

DEFAULT = SamplingParams()
MAX_N = 16  # choices of one prompt


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float | None = Field(DEFAULT.temperature, description="0: greedy")
    top_p: float | None = Field(DEFAULT.top_p, description="nucleus sampling: (0, 1]")
    top_k: int | None = Field(DEFAULT.top_k, description="the k most likely tokens only (vLLM's); 0 or null: all")
    seed: int | None = Field(
        DEFAULT.seed, description="the same seed gives the same text, alone or batched with others"
    )
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOPS} strings; the text ends before the first found"
    )
    ignore_eos: bool = Field(DEFAULT.ignore_eos, description="go on past EOS up to max_tokens (vLLM's, for benchmarks)")

    def sampling(
        self, max_tokens: int | None, logprobs: int | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams (SamplingParamsError names a bad value); null: the default."""
        return SamplingParams(
            max_tokens=DEFAULT.max_tokens if max_tokens is None else max_tokens,
            temperature=DEFAULT.temperature if self.temperature is None else self.temperature,
            top_k=self.top_k or DEFAULT.top_k,
            top_p=DEFAULT.top_p if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop,  # as it came: a lone "" is refused as [""] is
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="a last chunk with no choices and the usage")


class OpenAIFields(SamplingFields):
    """OpenAI's fields beside the sampling ones, in completions and chat alike."""

    n: int | None = Field(
        1,
        description=f"choices per prompt, 1 to {MAX_N}; with a seed, choice j > 0 draws from the seed's j-th child, "
        "so a request gives the same choices alone or batched",
    )
    stream: bool = Field(False, description="server-sent events: a chunk per text delta, then `data: [DONE]`")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and not used")
    presence_penalty: float | None = Field(0.0, description="0 only: not built")
    frequency_penalty: float | None = Field(0.0, description="0 only: not built")
    logit_bias: dict[str, float] | None = Field(None, description="null or {} only: not built")

    def unsupported(self) -> list[str]:
        """The fields given a value that is not built, as `name=value`."""
        given = [
            ("presence_penalty", self.presence_penalty not in (None, 0)),
            ("frequency_penalty", self.frequency_penalty not in (None, 0)),
            ("logit_bias", bool(self.logit_bias)),
        ]
        return [f"{name}={getattr(self, name)!r}" for name, bad in given if bad]
