"""The ingress's HTTP protocol pieces: a response's writes coalesced into one send, nothing written lost on close or
EOF, and (on a real uvicorn server on loopback) the count of requests in progress. The whole server runs in
tests/test_reliability.py (direct ingress) and behind Serve's proxy in every API test."""

from __future__ import annotations

import asyncio

import uvicorn

from service.http_server import CoalescedWrites, LimitedHttpProtocol
from service.ports import free_port


class RecordingTransport(asyncio.Transport):
    """The socket's side of a transport: each `write` is one send."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[bytes] = []
        self.closed = self.eof = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.sends.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def write_eof(self) -> None:
        self.eof = True


def test_a_head_and_body_written_in_one_loop_turn_leave_in_one_send():
    async def respond() -> list[bytes]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        writes.write(b"{}")
        assert sent.sends == []  # held until the turn ends (or the response completes: flush)
        await asyncio.sleep(0)
        writes.write(b"next")  # a later turn: its own send
        await asyncio.sleep(0)
        return sent.sends

    assert asyncio.run(respond()) == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b"next"]


def test_close_and_eof_send_what_is_pending_first_and_a_closed_transport_gets_nothing():
    async def refuse() -> RecordingTransport:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.write(b"HTTP/1.1 413 ")
        writes.write_eof()
        assert sent.sends == [b"HTTP/1.1 413 "] and sent.eof
        writes.write(b"late")
        writes.close()
        writes.write(b"after close")
        await asyncio.sleep(0)  # the scheduled flush finds the transport closing: dropped, never raised
        return sent

    sent = asyncio.run(refuse())
    assert sent.sends == [b"HTTP/1.1 413 ", b"late"] and sent.closed


def test_a_flush_with_nothing_pending_sends_nothing():
    async def idle() -> list[bytes]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.flush()
        writes.write(b"x")
        writes.flush()  # what LimitedHttpProtocol.on_response_complete does
        await asyncio.sleep(0)  # the turn's scheduled flush: nothing left
        return sent.sends

    assert asyncio.run(idle()) == [b"x"]


async def _serving(app):
    """A real uvicorn server with LimitedHttpProtocol on a free loopback port, started in this event loop."""
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), http=LimitedHttpProtocol, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, config.port


def test_requests_in_progress_counts_each_request_from_its_head_to_its_answer_or_its_client_leaving_pipelined_too():
    seen: list[int] = []
    hold = asyncio.Event()

    async def app(scope, receive, send):
        seen.append(LimitedHttpProtocol.in_progress)
        if scope["path"] == "/hold":
            await hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def scenario() -> list[int]:
        server, task, port = await _serving(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(3):  # one after another on a keep-alive connection: each alone
                writer.write(b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readuntil(b"{}")
            held = await asyncio.open_connection("127.0.0.1", port)
            held[1].write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.1)
            writer.write(b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n")  # beside the held one
            await reader.readuntil(b"{}")
            held[1].close()  # its client leaves before the answer
            await asyncio.sleep(0.1)
            after = LimitedHttpProtocol.in_progress
            writer.write(b"GET /pipelined HTTP/1.1\r\nHost: x\r\n\r\n" * 2)  # two heads in one send
            await reader.readuntil(b"{}")
            await reader.readuntil(b"{}")
            await asyncio.sleep(0.05)
            hold.set()
            writer.close()
            return [*seen[:5], after, *seen[5:], LimitedHttpProtocol.in_progress]  # pipelined: both heads in, then one
        finally:
            server.should_exit = True
            await task

    before = LimitedHttpProtocol.in_progress
    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [before + n for n in (1, 1, 1, 1, 2, 0, 2, 1, 0)]
