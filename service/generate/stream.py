"""The consumer's side of one sequence: an async iterator of TokenEvent on the consumer's event loop. Leaving it
(aclose, `async with` exit, its task cancelled while it waits, or the stream dropped) ends the sequence. No torch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from service.generate.output import CANCELLED
from service.generate.request import TokenEvent
from service.generate.sequence import Sequence


class TokenStream:
    """Events arrive through the sequence's sink (an asyncio.Queue the engine's thread fills through the loop); the
    last one has a finish_reason. An error (QueueTimeoutError, GenerationFailedError) is raised instead of an event,
    and ends the stream."""

    def __init__(self, seq: Sequence, stop: Callable[[Sequence, str], None]) -> None:
        self._seq, self._stop = seq, stop
        self._done = False

    @property
    def prompt_tokens(self) -> int:
        return len(self._seq.prompt)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._seq.sink.get()
        except asyncio.CancelledError:  # the consumer's task was cancelled (a client that went away)
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finish_reason is not None
        return item

    def cancel(self) -> None:
        """End the sequence: it leaves the batch at the next step and its KV reservation is freed."""
        if not self._done:
            self._done = True
            self._stop(self._seq, CANCELLED)

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()

    def __del__(self) -> None:
        # Dropped without being finished (a consumer that broke out of its loop): flag the sequence only, without the
        # scheduler's lock, which the garbage collector may run this under; the next step sees the flag.
        if not self._done and self._seq.stop_reason is None:
            self._seq.stop_reason = CANCELLED
