"""What one step computes, as the scheduler plans it and the step runner runs it: a token for each decoding sequence,
and prompt tokens as chunks of contexts. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from service.generate.sequence import Sequence


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens a step runs for one sequence: its context's [start, start + count), those before it cached."""

    seq: Sequence
    start: int
    count: int

    @classmethod
    def whole(cls, seq: Sequence) -> Chunk:
        return cls(seq, 0, len(seq.context))

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.count == len(self.seq.context)

    @property
    def last(self) -> bool:
        """Whether its context has run once this chunk has: the sequence then has its first token."""
        return self.start + self.count == len(self.seq.context)


@dataclass(frozen=True)
class Schedule:
    """One step's plan, handed to the step runner and then to the update. Every row not of `decode` or `prefill`
    leaves the batch."""

    step: int
    # prompt tokens (a resumed sequence's tokens so far too): whole prompts run together, or one chunk of a long one
    prefill: tuple[Chunk, ...]
    decode: tuple[Sequence, ...]  # running, their context run: one token each
    left: tuple[Sequence, ...]  # ended from outside (cancelled, aborted) since the last step: their last events
    expired: tuple[Sequence, ...]  # waited past queue_timeout_s without starting: they end with QueueTimeoutError
    drop_left: bool = False  # rows that left stand in the way of a waiting sequence: drop them now

    @property
    def prefilling(self) -> tuple[Sequence, ...]:
        return tuple(chunk.seq for chunk in self.prefill)

    @property
    def running(self) -> tuple[Sequence, ...]:
        """The sequences this step computes for: their rows stay, every other row leaves."""
        return self.decode + self.prefilling

    @property
    def chunk(self) -> Chunk | None:
        """The prefill's chunk of a long prompt (run alone), or None when it runs whole prompts (or none)."""
        return self.prefill[0] if len(self.prefill) == 1 and not self.prefill[0].is_whole else None
