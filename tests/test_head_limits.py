"""The ingress's own HTTP server and the one uvicorn adapter (service/http/head_limits.py) on a real uvicorn on
loopback: heads over the limits refused as they arrive, a request cancelled when its client leaves, requests in
progress counted from their head, the replica's signals left alone; a response's writes coalesced into one send.
Each test fails when the adapter's hook into uvicorn stops engaging. The whole service: tests/test_reliability.py."""

from __future__ import annotations

import asyncio
import signal

from service.config import RequestLimits
from service.http.head_limits import CoalescedWrites
from service.http.server import HttpServer
from service.local.ports import free_port

LIMITS = RequestLimits(max_header_bytes=1024, max_headers=8, max_body_bytes=1024)


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
        writes.flush()  # what HeadLimitedProtocol.on_response_complete does
        await asyncio.sleep(0)  # the turn's scheduled flush: nothing left
        return sent.sends

    assert asyncio.run(idle()) == [b"x"]


async def _serve(app, **limits) -> tuple[HttpServer, int]:
    port = free_port()
    server = HttpServer(app, "127.0.0.1", port, LIMITS.model_copy(update=limits))
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return server, port
        except OSError:
            await asyncio.sleep(0.01)
    raise AssertionError("the server did not start")


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    return answer


def test_a_head_over_the_limit_is_refused_with_a_json_431_before_it_all_arrives():
    async def scenario() -> tuple[bytes, bytes, bytes]:
        _, port = await _serve(_ok)
        big = await _exchange(port, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
        many = await _exchange(port, b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(20)) + b"\r\n")
        # an unfinished head: refused once more than the limit has arrived, without waiting for its end
        unfinished = await _exchange(port, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 4096)
        return big, many, unfinished

    big, many, unfinished = asyncio.run(scenario())
    for answer in (big, unfinished):
        assert answer.startswith(b"HTTP/1.1 431") and b"over the limit of 1024 bytes" in answer, answer[:200]
    assert many.startswith(b"HTTP/1.1 431") and b"more than 8 request headers" in many


def test_expect_100_continue_for_a_body_over_the_limit_gets_413_and_no_100_continue():
    async def scenario() -> bytes:
        _, port = await _serve(_ok)
        head = b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n"
        return await _exchange(port, head)

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer


def test_a_request_whose_client_leaves_is_cancelled_and_in_progress_counts_requests_from_their_head():
    async def scenario() -> tuple[list[int], bool, int]:
        cancelled = asyncio.Event()
        started = asyncio.Event()
        seen: list[int] = []

        async def app(scope, receive, send):
            seen.append(server.requests_in_progress())
            if scope["path"] == "/hold":
                started.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
            await _ok(scope, receive, send)

        server, port = await _serve(app)
        _, held = await asyncio.open_connection("127.0.0.1", port)
        held.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await started.wait()
        await _exchange(port, b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n")  # beside the held one: two in progress
        held.close()  # its client leaves before the answer
        await asyncio.wait_for(cancelled.wait(), 5)
        await asyncio.sleep(0.05)
        await _exchange(port, b"GET /alone HTTP/1.1\r\nHost: x\r\n\r\n")
        return seen, cancelled.is_set(), server.requests_in_progress()

    seen, cancelled, after = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert seen == [1, 2, 1] and cancelled and after == 0


def test_the_server_leaves_the_processs_signal_handlers_alone_and_refuses_a_taken_port():
    before = signal.getsignal(signal.SIGTERM)

    async def scenario() -> str:
        server, port = await _serve(_ok)
        await asyncio.sleep(0.2)
        server.check()  # still serving
        try:
            HttpServer(_ok, "127.0.0.1", port, LIMITS)
        except OSError as exc:
            return str(exc)
        return ""

    message = asyncio.run(scenario())
    assert signal.getsignal(signal.SIGTERM) is before
    assert "the ingress cannot listen on 127.0.0.1:" in message
