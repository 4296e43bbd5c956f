"""A streamed answer whose client takes none of it (service/http/generate.py EventStream): once a write has waited
send_timeout_s, the token events are closed, so the sequence leaves the batch, and the connection is aborted where the
server offers it (the ingress's own server's ABORT), else the answer ends unfinished; a client that reads gets the
whole stream, its first event in a loop turn of its own (so that it leaves in a send of its own)."""

from __future__ import annotations

import asyncio

from service.http.generate import EventStream
from service.http.uvicorn_adapter import ABORT

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}


class Events:
    """Token events as the data plane hands them over: an async iterator whose aclose ends the sequence."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.closed = False
        self.log = log if log is not None else []

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True
        self.log.append("events closed")


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


async def _stalled_after(sent: list[dict], count: int, message: dict) -> None:
    """A send whose transport's buffer is full after `count` messages."""
    if len(sent) >= count:
        await asyncio.Event().wait()
    sent.append(message)


def test_a_stalled_stream_closes_its_events_then_aborts_the_connection_where_the_server_offers_it():
    log: list[str] = []
    sent: list[dict] = []
    scope = SCOPE | {ABORT: lambda: log.append("aborted")}
    events = Events(log)
    response = EventStream(_body(1000), events, send_timeout_s=0.2)
    asyncio.run(asyncio.wait_for(response(scope, _never, lambda m: _stalled_after(sent, 2, m)), 10))
    assert log == ["events closed", "aborted"]  # the sequence leaves before the connection goes
    assert len(sent) == 2 and sent[-1].get("more_body") is True


def test_a_reading_client_is_never_aborted():
    log: list[str] = []
    sent: list[dict] = []

    async def reading(message: dict) -> None:
        sent.append(message)

    scope = SCOPE | {ABORT: lambda: log.append("aborted")}
    asyncio.run(asyncio.wait_for(EventStream(_body(5), Events(log), send_timeout_s=0.2)(scope, _never, reading), 10))
    assert log == ["events closed"] and sent[-1].get("more_body", False) is False


def test_the_first_event_is_sent_in_a_loop_turn_of_its_own_and_later_ones_may_share_one():
    """The ingress's own server writes what a loop turn sends in one send (CoalescedWrites): a callback scheduled when
    a body is sent runs before the next body is sent only if the stream let the turn end in between."""
    order: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message["body"]:
                order.append(message["body"].decode().strip())
                loop.call_soon(order.append, "turn ended")

        await EventStream(_body(3), Events(), send_timeout_s=1)(SCOPE, _never, send)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert order[:2] == ["data: 0", "turn ended"]
    assert order[2:4] == ["data: 1", "data: 2"], order  # already made: written together
