"""The choices of one generation request (a batch's prompts, `n` each): their sequences' events as one async iterator
of (index, event) on the consumer's loop, in the order they come. No torch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from service.generate.request import GenerateRequest, TokenEvent


class Stream(Protocol):
    """One sequence's events (TokenStream here, RemoteStream from a decoder's replica); `cancel` ends it."""

    prompt_tokens: int

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...
    def cancel(self) -> None: ...


class Placement(Protocol):
    """Where a decoder runs (service/decoder_placement.py, service/remote_decoder.py): it takes a request's sequence."""

    def submit(self, request: GenerateRequest) -> Stream: ...


class Choices:
    """One stream is read as it is. Several are each read by a task of their own that hands over one event at a time,
    so a consumer that stops reading leaves every stream's own bound (TokenStream's unsent bytes) to pause its
    sequence. A stream's error (a queue timeout, a failed step) is raised, and ends the request. `close` cancels
    every stream."""

    def __init__(self, streams: list[Stream]) -> None:
        self.streams = streams
        self._one = aiter(streams[0]) if len(streams) == 1 else None
        self._handover: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue(maxsize=1)
        self._tasks: list[asyncio.Task] = []
        self._open = len(streams)

    @classmethod
    def submit(cls, placement: Placement, requests: list[GenerateRequest]) -> Choices:
        """Each request submitted, in order; if one is refused, those before it are cancelled and the refusal raised."""
        streams: list[Stream] = []
        try:
            for request in requests:
                streams.append(placement.submit(request))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return cls(streams)

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        if self._one is not None:
            return 0, await anext(self._one)
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._read(i, stream)) for i, stream in enumerate(self.streams)]
        while self._open:
            index, item = await self._handover.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def _read(self, index: int, stream: Stream) -> None:
        try:
            async for event in stream:
                await self._handover.put((index, event))
        except Exception as exc:  # handed to the consumer, which raises it
            await self._handover.put((index, exc))
            return
        await self._handover.put((index, None))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            stream.cancel()
