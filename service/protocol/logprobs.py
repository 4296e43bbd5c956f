"""A choice's logprobs, built from its token events as they come (with `echo`, its prompt's text and tokens first),
and written in OpenAI's two formats: the completions' lists (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and the chat's `content`. No torch."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from contract.tokenizer import NUM_SPECIAL, ByteTokenizer
from service.generate import TokenEvent
from service.generate.sampling import TokenLogprobs


@dataclass(frozen=True)
class Entry:
    token: TokenLogprobs
    offset: int  # where its text begins in the choice's text
    first: bool = False  # an echoed prompt's first token: nothing before it gives it a logprob


class ChoiceLogprobs:
    """One choice's: `take` an event, get the echoed prompt's text it brings (once) and its entries."""

    def __init__(self, echo: bool) -> None:
        self._echo = echo
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0  # characters of the choice's text so far, as its tokens decode
        self.entries: list[Entry] = []

    def take(self, event: TokenEvent) -> tuple[str, list[Entry]]:
        added: list[Entry] = []
        echoed = ""
        if self._echo and event.prompt_logprobs is not None:
            for at, token in enumerate(event.prompt_logprobs):
                echoed += self._add(added, token, first=at == 0)
            echoed += self._utf8.decode(b"", final=True)  # the prompt's text ends whole
        for token in event.logprobs:
            self._add(added, token)
        self.entries += added
        return echoed, added

    def _add(self, added: list[Entry], token: TokenLogprobs, first: bool = False) -> str:
        added.append(Entry(token, self._offset, first))
        text = self._utf8.decode(bytes((token.token - NUM_SPECIAL,))) if token.token >= NUM_SPECIAL else ""
        self._offset += len(text)
        return text


def completion_logprobs(entries: list[Entry]) -> dict[str, list[Any]]:
    """The completions' format: parallel lists, the alternatives by token string (null for a prompt's first)."""
    return {
        "tokens": [_text(e.token.token) for e in entries],
        "token_logprobs": [None if e.first else e.token.logprob for e in entries],
        "top_logprobs": [None if e.first else {_text(t): lp for t, lp in e.token.top} for e in entries],
        "text_offset": [e.offset for e in entries],
    }


def chat_logprobs(entries: list[Entry]) -> dict[str, list[Any]]:
    """The chat's format: an object per token, with its bytes, and its alternatives likewise."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _text(token), "logprob": logprob, "bytes": _bytes(token)}

    return {
        "content": [
            one(e.token.token, e.token.logprob) | {"top_logprobs": [one(*t) for t in e.token.top]} for e in entries
        ]
    }


def _text(token: int) -> str:
    return ByteTokenizer.token_text(token)


def _bytes(token: int) -> list[int]:
    return [token - NUM_SPECIAL] if token >= NUM_SPECIAL else list(_text(token).encode())
