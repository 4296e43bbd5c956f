"""The consumer's side of one sequence: an async iterator of TokenEvent on the consumer's event loop, over a buffer
of the events its consumer has not taken, bounded in bytes: past UNSENT_BYTES the sequence is paused (no longer fed;
its row dropped), and resumed once its consumer has taken half. Leaving it (aclose, `async with` exit, its task
cancelled while it waits, or the stream dropped) ends the sequence. No torch."""

from __future__ import annotations

import asyncio
from typing import Protocol

from service.generate.output import CANCELLED
from service.generate.request import TokenEvent
from service.generate.sequence import Sequence

# An event's cost in the buffer: its text, and what a TokenEvent object and its tuple take (sys.getsizeof, rounded
# up). 16 KiB is about 70 one-token events: a consumer that far behind is not reading (one that reads takes each
# step's events within the step), and a paused sequence costs its recomputation once it reads again.
EVENT_BYTES = 224
UNSENT_BYTES = 16 << 10


class Controls(Protocol):
    """What a stream asks of its engine's scheduler."""

    def stop(self, seq: Sequence, reason: str) -> None: ...
    def pause(self, seq: Sequence) -> None: ...
    def resume(self, seq: Sequence) -> None: ...


def cost(item: TokenEvent | BaseException) -> int:
    return EVENT_BYTES + len(item.text) if isinstance(item, TokenEvent) else 0


class TokenStream:
    """Events arrive through `put` (the engine's thread hands them to the consumer's loop); the last one has a
    finish_reason. An error (QueueTimeoutError, GenerationFailedError) is raised instead of an event, and ends the
    stream."""

    def __init__(self, seq: Sequence, controls: Controls) -> None:
        self._seq, self._controls = seq, controls
        self._events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._done = self._paused = False
        seq.sink = self

    @property
    def prompt_tokens(self) -> int:
        return len(self._seq.prompt)

    def put(self, item: TokenEvent | BaseException) -> None:
        """An event (or error) for the consumer, on its loop; past UNSENT_BYTES unread, the sequence is paused."""
        self._events.put_nowait(item)
        self._seq.unsent += cost(item)
        if self._seq.unsent > UNSENT_BYTES and not self._paused and not self._done:
            self._paused = True
            self._controls.pause(self._seq)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._events.get()
        except asyncio.CancelledError:  # the consumer's task was cancelled (a client that went away)
            self.cancel()
            raise
        self._seq.unsent -= cost(item)
        if self._paused and self._seq.unsent <= UNSENT_BYTES // 2:
            self._paused = False
            self._controls.resume(self._seq)
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finish_reason is not None
        return item

    def cancel(self) -> None:
        """End the sequence: it leaves the batch at the next step and its KV charge is freed."""
        if not self._done:
            self._done = True
            self._controls.stop(self._seq, CANCELLED)

    async def aclose(self) -> None:
        self.cancel()

    def __del__(self) -> None:
        # Dropped without being finished (a consumer that broke out of its loop): flag the sequence only, without the
        # scheduler's lock, which the garbage collector may run this under; the next step sees the flag.
        if not self._done and self._seq.stop_reason is None:
            self._seq.stop_reason = CANCELLED
