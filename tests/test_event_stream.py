"""A streamed answer whose client takes none of it (service/http/generate.py EventStream): once a write has waited
send_timeout_s, the answer ends unfinished (the server then closes the connection) and the token events are closed,
so the sequence leaves the batch; a client that reads gets the whole stream."""

from __future__ import annotations

import asyncio

from service.http.generate import EventStream

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}


class Events:
    """Token events as the data plane hands them over: an async iterator whose aclose ends the sequence."""

    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


async def _body(chunks: int):
    for i in range(chunks):
        yield f"data: {i}\n\n".encode()


async def _never() -> dict:
    await asyncio.Event().wait()
    return {}


def test_a_client_that_takes_nothing_for_send_timeout_s_ends_the_stream_and_its_events():
    sent: list[dict] = []

    async def stalled(message: dict) -> None:  # the transport's buffer is full after the head and one chunk
        if len(sent) >= 2:
            await asyncio.Event().wait()
        sent.append(message)

    events = Events()
    response = EventStream(_body(1000), events, send_timeout_s=0.2)
    asyncio.run(asyncio.wait_for(response(SCOPE, _never, stalled), 10))
    assert events.closed
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[-1].get("more_body") is True  # unfinished: the server closes the connection


def test_a_client_that_reads_gets_the_whole_stream_and_the_events_are_closed():
    sent: list[dict] = []

    async def reading(message: dict) -> None:
        sent.append(message)

    events = Events()
    asyncio.run(asyncio.wait_for(EventStream(_body(5), events, send_timeout_s=0.2)(SCOPE, _never, reading), 10))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert b"".join(bodies) == b"".join(f"data: {i}\n\n".encode() for i in range(5)) and events.closed
    assert sent[-1].get("more_body", False) is False
