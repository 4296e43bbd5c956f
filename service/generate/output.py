"""One sequence's output: token ids to text deltas (byte-v1 tokens through an incremental UTF-8 decoder, so a character
split across tokens comes out whole), stop strings found across token boundaries and never returned, EOS, max_tokens,
and the finish reasons. No torch."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from contract.tokenizer import NUM_SPECIAL
from service.generate.sampling import SamplingParams

# Why a sequence ended (the last event's finish_reason). OpenAI's `finish_reason` is "stop" for STOP and EOS and
# "length" for LENGTH; the OIP generate extension's `details.finish_reason` is stop_sequence, eos_token, length.
STOP = "stop"  # a stop string was generated: the text ends before it
EOS = "eos"  # the model generated its end-of-sequence token (and ignore_eos was false)
LENGTH = "length"  # max_tokens were generated
CANCELLED = "cancelled"  # the consumer went away (stopped iterating, or its task was cancelled)
ABORT = "abort"  # the engine ended it: drained past its grace, or closed
FINISH_REASONS = (STOP, EOS, LENGTH, CANCELLED, ABORT)
# As OpenAI's API and vLLM's metrics (`finished_reason`) say them: a client gone is an abort there too.
OPENAI_FINISH_REASONS = {STOP: "stop", EOS: "stop", LENGTH: "length", CANCELLED: "abort", ABORT: "abort"}


@dataclass(frozen=True)
class Delta:
    """What one token adds to the text, and whether the sequence ends with it."""

    text: str
    finish_reason: str | None = None


class TextOutput:
    """Per sequence, fed one token at a time on the engine's thread. Text that could be the start of a stop string
    is held back until the next tokens show it is not; it is released when the sequence ends otherwise."""

    def __init__(self, params: SamplingParams, eos_id: int, takes_text: bool) -> None:
        self._params, self._eos_id, self._takes_text = params, eos_id, takes_text
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not yet returned: a suffix that may begin a stop string
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self.tokens = 0  # completion tokens so far, EOS and the tokens of a stop string included

    def add(self, token: int) -> Delta:
        """The text delta of the next generated token; a finish_reason when the sequence ends with it."""
        self.tokens += 1
        if token == self._eos_id and not self._params.ignore_eos:
            return Delta(self.flush(), EOS)
        text = self._held + self._decode(token)
        for cut in self._stops_in(text):
            self._held = ""
            return Delta(text[:cut], STOP)
        keep = self._could_start_stop(text)
        self._held = text[len(text) - keep :]
        delta = text[: len(text) - keep]
        if self.tokens >= self._params.max_tokens:
            return Delta(delta + self.flush(), LENGTH)
        return Delta(delta)

    def flush(self) -> str:
        """What is held back (incomplete UTF-8 bytes as U+FFFD), once the sequence ends for any other reason."""
        text = self._held + (self._utf8.decode(b"", final=True) if self._takes_text else "")
        self._held = ""
        return text

    def _decode(self, token: int) -> str:
        if not self._takes_text or token < NUM_SPECIAL:  # special ids (PAD, BOS, UNK, an ignored EOS) have no text
            return ""
        return self._utf8.decode(bytes((token - NUM_SPECIAL,)))

    def _stops_in(self, text: str) -> list[int]:
        """The index where the earliest stop string found in `text` begins, as a list of none or one."""
        found = [i for i in (text.find(s) for s in self._params.stop) if i >= 0]
        return [min(found)] if found else []

    def _could_start_stop(self, text: str) -> int:
        """The length of the longest end of `text` that is the beginning of a stop string (0: none)."""
        for keep in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[len(text) - keep :]
            if any(s.startswith(tail) for s in self._params.stop):
                return keep
        return 0
