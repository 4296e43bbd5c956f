"""The ingress's own HTTP server and the one uvicorn adapter (service/http/uvicorn_adapter.py) on a real uvicorn on
loopback: heads over the limits refused as they arrive, slow heads and silent connections cut at header_timeout_s,
pipelined heads measured from their own first byte and refused after the answers before them, idle keep-alive
bounded, connections over the cap refused, each counted; a request cancelled when its client leaves, requests in
progress counted from their head, the replica's signals left alone; a response's writes coalesced into one send, yet
written at once past FLUSH_BYTES so that a client that reads nothing holds back the application's sends; each
request's arrival noted and an abort offered in its scope; refusals under /openai/ in OpenAI's error shape. Each test
fails when the adapter's hook into uvicorn stops engaging. The whole service: tests/test_reliability.py
and tests/test_slow_heads.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import socket
import time

from service.config import RequestLimits
from service.http.coalesced_writes import FLUSH_BYTES, CoalescedWrites
from service.http.limits import RequestLimitsMiddleware
from service.http.server import HttpServer
from service.http.uvicorn_adapter import ABORT, ARRIVED, STOP_IDLE_S
from service.local.ports import free_port

LIMITS = RequestLimits(max_header_bytes=1024, max_headers=8, max_body_bytes=1024)


class RecordingTransport(asyncio.Transport):
    """The socket's side of a transport: each `write` is one send."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[bytes] = []
        self.closed = self.eof = self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.sends.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def write_eof(self) -> None:
        self.eof = True

    def abort(self) -> None:
        self.closed = self.aborted = True


def test_a_head_and_body_written_in_one_loop_turn_leave_in_one_send():
    async def respond() -> list[bytes]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop(), lambda: False)
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
        writes = CoalescedWrites(sent, asyncio.get_running_loop(), lambda: False)
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
        writes = CoalescedWrites(sent, asyncio.get_running_loop(), lambda: False)
        writes.flush()
        writes.write(b"x")
        writes.flush()  # what HeadLimitedProtocol.on_response_complete does
        await asyncio.sleep(0)  # the turn's scheduled flush: nothing left
        return sent.sends

    assert asyncio.run(idle()) == [b"x"]


async def _serve(app, keep_alive_s: int = 30, **limits) -> tuple[HttpServer, int]:
    port = free_port()
    server = HttpServer(app, "127.0.0.1", port, LIMITS.model_copy(update=limits), keep_alive_s=keep_alive_s)
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return server, port
        except OSError:
            await asyncio.sleep(0.01)
    raise AssertionError("the server did not start")


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def _ok_after(seconds: float):
    """An application answering as `_ok` does, `seconds` after each request arrives."""

    async def app(scope, receive, send) -> None:
        await asyncio.sleep(seconds)
        await _ok(scope, receive, send)

    return app


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


def test_a_pipelined_head_split_across_reads_is_measured_from_its_own_first_byte():
    """HTTP/1.1 pipelining: a request's last bytes and the start of the next one's head arrive in one read. Only
    the head's own bytes count towards max_header_bytes: both requests are answered, in order."""

    async def scenario() -> bytes:
        _, port = await _serve(_ok)
        body = b"x" * 1000  # under max_body_bytes (1024), and with the next head's start over max_header_bytes
        second = b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + body + second[:12])
        await asyncio.sleep(0.2)  # the rest of the second head in a read of its own
        writer.write(second[12:])
        answers = b""
        while answers.count(b"{}") < 2 and (chunk := await asyncio.wait_for(reader.read(65536), 5)):
            answers += chunk
        writer.close()
        return answers

    answers = asyncio.run(scenario())
    assert answers.count(b"HTTP/1.1 200 OK") == 2 and b"431" not in answers, answers


def test_a_pipelined_head_over_the_limit_is_refused_after_the_answers_before_it():
    """A head over the limits behind a request still in progress on its connection: that request is answered
    first, then the refusal, then the connection closes (answers keep their requests' order)."""

    async def scenario() -> bytes:
        _, port = await _serve(_ok_after(0.3))  # the first still in progress when the next head is refused
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        big = b"GET /second HTTP/1.1\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n"
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n" + big)
        answer, _ = await _until_closed(reader, 5)
        writer.close()
        return answer

    answer = asyncio.run(scenario())
    first, _, rest = answer.partition(b"{}")
    assert first.startswith(b"HTTP/1.1 200 OK"), answer[:300]
    assert rest.startswith(b"HTTP/1.1 431") and b"over the limit of 1024 bytes" in rest, answer[:400]


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


async def _until_closed(
    reader: asyncio.StreamReader, within_s: float, start: float | None = None
) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took from `start` (a
    perf_counter() taken before the connection was opened, where the server's clock starts at its accept; now if
    None)."""
    start = time.perf_counter() if start is None else start
    answer = b""
    while chunk := await asyncio.wait_for(reader.read(65536), within_s):
        answer += chunk
    return answer, time.perf_counter() - start


def test_a_trickled_head_is_cut_at_header_timeout_s_with_a_json_408_and_counted():
    async def scenario() -> tuple[bytes, float, int]:
        server, port = await _serve(_ok, header_timeout_s=1.0)
        opened = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n")

        async def trickle() -> None:  # a header line every 0.2 s: each byte must not push the deadline back
            for i in itertools.count():
                await asyncio.sleep(0.2)
                writer.write(b"X-Slow-%d: v\r\n" % i)

        trickling = asyncio.create_task(trickle())
        answer, seconds = await _until_closed(reader, 5, opened)
        trickling.cancel()
        writer.close()
        return answer, seconds, server.connection_metrics.header_timeouts

    answer, seconds, timeouts = asyncio.run(scenario())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), answer[:300]
    assert json.loads(body)["error"].startswith("the request head did not arrive within 1 s (")
    assert 1.0 <= seconds < 2.0 and timeouts == 1, seconds


def test_a_pipelined_head_cut_at_header_timeout_s_gets_its_408_after_the_answer_before_it():
    async def scenario() -> tuple[bytes, float]:
        _, port = await _serve(_ok_after(1.5), header_timeout_s=1.0)  # the first in progress past the next head's time
        opened = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\nGET /second HTTP/1.1\r\nX-Slow: ")
        answer, seconds = await _until_closed(reader, 5, opened)
        writer.close()
        return answer, seconds

    answer, seconds = asyncio.run(scenario())
    first, _, rest = answer.partition(b"{}")
    assert first.startswith(b"HTTP/1.1 200 OK") and rest.startswith(b"HTTP/1.1 408"), answer[:400]
    assert 1.5 <= seconds < 3.0, seconds


def test_a_connection_that_sends_nothing_is_closed_without_an_answer_at_header_timeout_s():
    async def scenario() -> tuple[bytes, float, int]:
        server, port = await _serve(_ok, header_timeout_s=1.0)
        opened = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer, seconds = await _until_closed(reader, 5, opened)
        writer.close()
        return answer, seconds, server.connection_metrics.header_timeouts

    answer, seconds, timeouts = asyncio.run(scenario())
    assert answer == b"" and 1.0 <= seconds < 2.0 and timeouts == 1, (answer, seconds)


def test_on_a_kept_alive_connection_idle_time_is_keep_alive_s_and_the_next_head_gets_header_timeout_s():
    """After a response: silence is bounded by the keep-alive timeout (closed, no answer); a next head that has
    begun (a bare CRLF too, which begins none yet stops uvicorn's keep-alive timer) by header_timeout_s."""

    async def scenario() -> list[tuple[bytes, float]]:
        _, port = await _serve(_ok, keep_alive_s=1, header_timeout_s=2.0)
        out = []
        for after_response in (b"", b"GET / HTTP/1.1\r\nX-Slow: ", b"\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            asked = time.perf_counter()  # before the server's timers start, which is at its response's end
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            first = await reader.readuntil(b"{}")
            writer.write(after_response)
            answer, seconds = await _until_closed(reader, 5, asked)
            out.append((first + answer, seconds))
            writer.close()
        return out

    (idle, idle_s), (slow, slow_s), (crlf, crlf_s) = asyncio.run(scenario())
    ok = b"HTTP/1.1 200 OK"
    assert idle.startswith(ok) and idle.count(b"HTTP/1.1") == 1 and 1.0 <= idle_s < 2.0, (idle, idle_s)
    assert slow.startswith(ok) and b"HTTP/1.1 408" in slow and 2.0 <= slow_s < 3.0, (slow, slow_s)
    assert crlf.startswith(ok) and crlf.count(b"HTTP/1.1") == 1 and 2.0 <= crlf_s < 3.0, (crlf, crlf_s)


def test_a_connection_over_max_connections_gets_a_json_503_with_retry_after_and_the_rest_are_served():
    async def scenario() -> tuple[bytes, bytes, int, int, int]:
        server, port = await _serve(_ok, max_connections=8)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
        await asyncio.sleep(0.1)  # all accepted
        open_at_cap = server.open_connections()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        refused, _ = await _until_closed(reader, 5)
        writer.close()
        _, first = held[0]
        first.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a connection under the cap is served as before
        served = await held[0][0].readuntil(b"{}")
        for _, w in held:
            w.close()
        await asyncio.sleep(0.2)
        server.connection_metrics.refresh()  # what the data plane calls every second: adds what was counted since
        server.connection_metrics.refresh()
        return refused, served, open_at_cap, server.connection_metrics.refused, server.open_connections()

    refused, served, open_at_cap, count, open_after = asyncio.run(scenario())
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), refused[:300]
    assert json.loads(body)["error"] == "the server holds its limit of 8 connections; retry later"
    assert served.startswith(b"HTTP/1.1 200") and open_at_cap == 8 and count == 1 and open_after == 0


def test_a_close_while_the_request_still_arrives_sends_the_answer_with_an_eof_and_closes_only_after_the_linger():
    async def refuse() -> tuple[bool, bool, bool]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop(), lambda: True)  # the body is still coming
        writes.write(b"HTTP/1.1 413 ")
        writes.close()  # what uvicorn does after an answer with `Connection: close`
        return sent.eof, sent.closed, writes.is_closing()

    eof, closed, closing = asyncio.run(refuse())
    assert eof and not closed and closing  # closed LINGER_S later (or when the client closes first)


def _chunked_over_the_limit(chunks: int) -> bytes:
    head = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + (b"400\r\n" + b"x" * 1024 + b"\r\n") * chunks + b"0\r\n\r\n"


async def _refuse_after_first_chunk(scope, receive, send) -> None:
    """An application refusing a body once it is over the limit, before the rest has arrived (service/limits.py)."""
    await receive()
    body = b'{"error": "over"}'
    headers = [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_a_413_given_while_a_large_chunked_body_arrives_is_read_whole_by_a_client_that_sends_it_all_first():
    """Closed at once over the unread body, the kernel reset the connection and the client lost the 413 (issue 56)."""

    async def scenario() -> tuple[int, bytes]:
        _, port = await _serve(_refuse_after_first_chunk)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = _chunked_over_the_limit(16 * 1024)  # 16 MiB, as Python's http.client sends: all, then read
        writer.write(request)
        await asyncio.wait_for(writer.drain(), 10)
        answer, _ = await _until_closed(reader, 10)
        writer.close()
        return len(request), answer

    sent, answer = asyncio.run(scenario())
    assert sent > 16 << 20 and answer.startswith(b"HTTP/1.1 413") and answer.endswith(b'{"error": "over"}'), answer


def test_bytes_that_are_not_http_get_a_json_400_and_the_connection_closes():
    async def scenario() -> bytes:
        _, port = await _serve(_ok)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n")  # a TLS hello, say
        answer, _ = await _until_closed(reader, 5)
        writer.close()
        return answer

    answer = asyncio.run(scenario())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head and b"Connection: close" in head, answer
    assert "not a valid HTTP/1.1 request" in json.loads(body)["error"]


def test_a_stop_answers_the_next_request_on_a_kept_alive_connection_with_connection_close_and_closes_idle_ones():
    """HttpServer.close: the listener closes; a connection whose client sends right then is answered with
    `Connection: close` (uvicorn's own shutdown closed it at once, resetting that request), and a connection left
    idle is closed once silent for STOP_IDLE_S (counted from its last request, which came before the stop)."""

    async def scenario() -> tuple[bytes, bytes, float, bool]:
        server, port = await _serve(_ok)
        request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", port)
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        for writer, reader in ((busy_w, busy_r), (idle_w, idle_r)):
            idle_sent = time.monotonic()  # the idle connection's silence begins after its last request
            writer.write(request)
            await asyncio.wait_for(reader.readuntil(b"{}"), 5)  # kept alive
        closing = asyncio.ensure_future(server.close(time.time() + 10))
        await asyncio.sleep(0.15)  # the listener has closed (uvicorn checks every 0.1 s)
        busy_w.write(request)  # sent after the stop began, on a kept-alive connection
        answer, _ = await _until_closed(busy_r, 5)
        idle, _ = await _until_closed(idle_r, 5)
        idle_s = time.monotonic() - idle_sent
        await asyncio.wait_for(closing, 5)
        try:
            await asyncio.open_connection("127.0.0.1", port)
            refused = False
        except OSError:
            refused = True
        return answer, idle, idle_s, refused

    answer, idle, idle_s, refused = asyncio.run(scenario())
    print(f"\nan idle connection closed {idle_s:.2f} s after its last request")
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower() and answer.endswith(b"{}")
    assert idle == b"" and idle_s >= STOP_IDLE_S and refused


def test_pending_bytes_past_flush_bytes_are_written_at_once_and_the_rest_at_the_end_of_the_turn():
    async def respond() -> tuple[list[bytes], list[bytes]]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop(), lambda: False)
        writes.write(b"h" * 100)
        writes.write(b"x" * FLUSH_BYTES)  # past the bound: written within this turn, where the transport may pause
        within_the_turn = list(sent.sends)
        writes.write(b"tail")
        await asyncio.sleep(0)
        return within_the_turn, sent.sends

    within_the_turn, sends = asyncio.run(respond())
    assert within_the_turn == [b"h" * 100 + b"x" * FLUSH_BYTES] and sends == [*within_the_turn, b"tail"]


def test_an_abort_drops_what_is_pending_and_aborts_the_transport():
    async def abort() -> RecordingTransport:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop(), lambda: False)
        writes.write(b"never sent")
        writes.abort()
        await asyncio.sleep(0)  # the turn's scheduled flush: nothing left
        return sent

    sent = asyncio.run(abort())
    assert sent.aborted and sent.sends == []


def _tcp_state(sock: socket.socket) -> int:
    """The socket's TCP state (struct tcp_info's first byte): 1 ESTABLISHED, 7 CLOSE (reset), 8 CLOSE_WAIT (EOF)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


async def _never_reading(port: int, request: bytes) -> socket.socket:
    """A client that sends `request` and reads nothing: a 4 KiB receive buffer, so the server's bytes pile up on the
    server's side."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it advertises
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)
    return sock


def test_a_client_that_reads_nothing_holds_back_the_applications_sends_within_a_loop_turn():
    """uvicorn's flow control (the transport pauses the protocol, the next send waits for the client) engages as the
    bytes are written: a stream whose chunks are all ready is not buffered whole for a client that reads nothing, as
    it was when every write waited for the end of the loop turn. What the kernel's send buffer takes (tcp_wmem's
    maximum) and a chunk or two are sent before a send waits."""
    chunk, chunks = 1 << 20, 64

    async def scenario() -> int:
        sent = 0

        async def app(scope, receive, send) -> None:
            nonlocal sent
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(chunks):
                await send({"type": "http.response.body", "body": b"x" * chunk, "more_body": True})
                sent += 1
            await send({"type": "http.response.body", "body": b""})

        _, port = await _serve(app)
        client = await _never_reading(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(1.0)
        client.close()
        return sent

    sent = asyncio.run(scenario())
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        kernel_max = int(f.read().split()[2])
    print(f"\n{sent} of {chunks} chunks of {chunk >> 20} MiB sent to a client that reads nothing")
    assert sent * chunk <= kernel_max + 2 * chunk, sent


def test_the_scope_notes_when_the_head_began_to_arrive_and_abort_closes_the_connection_at_once(caplog):
    """ARRIVED is the time of the request's first byte, however long its head takes; ABORT resets the connection of
    a client that reads nothing, whatever is buffered for it (a close would wait for it to read it all), without
    uvicorn's error for an unfinished answer."""

    async def scenario() -> tuple[float, dict[str, float], float, int]:
        seen: dict[str, float] = {}

        async def app(scope, receive, send) -> None:
            seen["arrived"], seen["app"] = scope[ARRIVED], time.perf_counter()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x" * (8 << 20), "more_body": True})
            seen["aborted"] = time.perf_counter()
            scope[ABORT]()

        _, port = await _serve(app)
        began = time.perf_counter()
        client = await _never_reading(port, b"GET / HTTP/1.1\r\nX-Slow: ")
        await asyncio.sleep(0.3)
        await asyncio.get_running_loop().sock_sendall(client, b"v\r\n\r\n")
        while "aborted" not in seen or (_tcp_state(client) == 1 and time.perf_counter() - seen["aborted"] < 2):
            await asyncio.sleep(0.01)
        closed_s, state = time.perf_counter() - seen["aborted"], _tcp_state(client)
        client.close()
        return began, seen, closed_s, state

    with caplog.at_level(logging.ERROR):
        began, seen, closed_s, state = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert began <= seen["arrived"] and seen["app"] - seen["arrived"] >= 0.3, seen  # the head's first byte
    assert state == 7 and closed_s < 1.5, (state, closed_s)  # reset: a close would wait on the unread bytes for good
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


def test_a_413_under_openai_is_openais_error_object_whoever_refuses_it():
    """The adapter refuses an `Expect: 100-continue` over the limit, the limits middleware a body announced over it
    (the application's stack, and Serve's proxy's); elsewhere the error stays `{"error": "..."}`."""

    async def scenario() -> list[bytes]:
        _, port = await _serve(RequestLimitsMiddleware(_ok, LIMITS))
        answers = []
        for path, expect in (("/openai/v1/completions", True), ("/openai/v1/completions", False), ("/v2/x", False)):
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
            answers.append(
                await _exchange(port, (head + ("Expect: 100-continue\r\n" if expect else "") + "\r\n").encode())
            )
        return answers

    answers = asyncio.run(scenario())
    assert all(a.startswith(b"HTTP/1.1 413") for a in answers), answers
    expected, announced, elsewhere = (json.loads(a.partition(b"\r\n\r\n")[2]) for a in answers)
    message = "request body of 5000 bytes is over the limit of 1024 bytes"
    for error in (expected, announced):
        assert error == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 413}}
    assert elsewhere == {"error": message}
