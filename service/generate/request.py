"""What goes into the generation engine and what comes out: a request (a prompt and its sampling parameters) and the
token events of its stream, with usage and timing on the last one. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from contract.decoder_metadata import DecoderMetadata
from contract.tokenizer import ByteTokenizer
from service.errors import BadRequestError, ContextLengthError, PromptError, SamplingParamsError, prefixed
from service.generate.sampling import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class GenerateRequest:
    """A prompt as text (encoded with the model's tokenizer, BOS first) or as token ids (used as they are)."""

    prompt: str | tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    # time.perf_counter() in this process when the request's head arrived (None: when it is submitted): time to first
    # token, queue time and end-to-end latency count from it, reading and parsing the body included
    arrived: float | None = None
    label: str = ""  # names it in its 400s, one of a batch ("prompt 2")
    until_context: bool = False  # max_tokens: what the context leaves after the prompt (OpenAI's chat default)

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list):  # from JSON: one spelling, a tuple
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")

    def checked(self, meta: DecoderMetadata) -> GenerateRequest:
        """This request for `meta`'s model once it passed every check against the model, all made here: by the
        engine's `submit`, and for a decoder in its own deployment by the ingress first, before any Ray call (its
        replica's engine then finds nothing wrong): its prompt as ids, and `until_context`'s max_tokens counted.
        PromptError, ContextLengthError or SamplingParamsError (a 400) say what is wrong, after the request's
        `label`."""
        try:
            prompt = self.token_ids(meta)
            if self.params.stop and not meta.takes_text:
                raise SamplingParamsError(
                    f"stop strings cannot be found: model {meta.name!r} makes token ids, no text ({meta.tokenizer!r})"
                )
            params = replace(self.params, max_tokens=meta.max_len - len(prompt)) if self.until_context else self.params
        except BadRequestError as exc:
            if not self.label:
                raise
            raise prefixed(exc, self.label) from None
        return replace(self, prompt=prompt, params=params, until_context=False)

    def token_ids(self, meta: DecoderMetadata) -> tuple[int, ...]:
        """The prompt's ids for `meta`'s model; PromptError or ContextLengthError (a 400) say what is wrong."""
        if isinstance(self.prompt, str):
            if not meta.takes_text:
                raise PromptError(f"model {meta.name!r} takes token ids only (tokenizer {meta.tokenizer!r}), not text")
            count = 1 + len(self.prompt.encode("utf-8"))  # BOS + one token per byte, counted before encoding
            self._check_context(meta, count)
            return tuple(ByteTokenizer(meta.max_len).encode(self.prompt))
        if not isinstance(self.prompt, tuple):
            raise PromptError(f"the prompt must be text or a list of token ids, not {type(self.prompt).__name__}")
        if not self.prompt:
            raise PromptError("the prompt is empty: give text or at least one token id")
        for i in self.prompt:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < meta.vocab_size:
                raise PromptError(
                    f"prompt token id {i!r} is outside model {meta.name!r}'s vocabulary [0, {meta.vocab_size})"
                )
        self._check_context(meta, len(self.prompt))
        return self.prompt

    def _check_context(self, meta: DecoderMetadata, prompt_tokens: int) -> None:
        wanted = 1 if self.until_context else self.params.max_tokens  # until the context's end: room for one at least
        if prompt_tokens + wanted > meta.max_len:
            raise ContextLengthError(meta.name, prompt_tokens, wanted, meta.max_len)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # EOS and the tokens of a stop string included


@dataclass(frozen=True)
class Timing:
    """perf_counter seconds of one request, for TTFT, queue time and end-to-end latency."""

    arrived: float  # when submitted
    queued_s: float  # arrival -> the start of its prefill (0 when it never started)
    first_token_s: float  # arrival -> its first token's event (0 when none)
    total_s: float  # arrival -> its last event


@dataclass(frozen=True)
class TokenEvent:
    """One step's output for one sequence. `time` (perf_counter, at the end of the step that made it) gives
    inter-token latency as the difference between consecutive events; the last event has a finish_reason, usage and
    timing, and may carry no token (cancelled, abort). The token ids include EOS and the tokens of a stop string,
    whose text is not returned."""

    token_ids: tuple[int, ...]
    text: str  # the text delta: whole characters, stop strings and what may begin one held back
    time: float
    step: int  # the engine step that made it: one apart between consecutive events of a running sequence
    finish_reason: str | None = None  # service/generate/output.py's FINISH_REASONS
    usage: Usage | None = None
    timing: Timing | None = None
    queued_s: float | None = None  # on the sequence's first event with a token: arrival -> the start of its prefill
    logprobs: tuple[TokenLogprobs, ...] = ()  # each token's, when its sampling parameters ask
    # the prompt's tokens' after the first, on the sequence's first event (with a token, or its last), when asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
