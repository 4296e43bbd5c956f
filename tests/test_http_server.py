"""The ingress's HTTP protocol pieces: a response's writes coalesced into one send, nothing written lost on close or
EOF, and (on a real uvicorn server on loopback) the count of requests in progress. The whole server runs in
tests/test_reliability.py (direct ingress) and behind Serve's proxy in every API test."""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.responses import Response

from service.config import RequestLimits
from service.http_server import HOLD_S, CoalescedWrites, LimitedHttpProtocol
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


def test_a_head_and_body_written_in_one_loop_turn_leave_in_one_send_and_write_now_sends_at_once():
    async def respond() -> list[bytes]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        writes.write(b"{}")
        assert sent.sends == []  # held until the turn ends (or the response completes: flush)
        await asyncio.sleep(0)
        writes.write(b"next")  # a later turn: its own send
        await asyncio.sleep(0)
        writes.write(b"a")
        writes.write_now(b"b")  # a whole response answered at once: what is pending and it, in one send, now
        assert sent.sends[-1] == b"ab"
        await asyncio.sleep(0)  # the turn's scheduled flush: nothing left
        return sent.sends

    assert asyncio.run(respond()) == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b"next", b"ab"]


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


class DirectAnswers:
    """What a real server of LimitedHttpProtocol does with inference requests when `direct` is installed: each call
    of `direct` and of the ASGI app, with the body each saw; `direct` answers unless `decline` is set."""

    def __init__(self, decline: bool = False) -> None:
        self.decline = decline
        self.direct_calls: list[tuple[str, str, bytes]] = []
        self.app_calls: list[tuple[str, bytes]] = []
        self.in_progress_seen: list[int] = []  # LimitedHttpProtocol.in_progress at each call of `direct`

        async def app(scope, receive, send) -> None:  # a function: what uvicorn recognises as an ASGI 3 app
            await self._app(scope, receive, send)

        self.app = app

    def direct(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Response | None:
        self.direct_calls.append((method, path, body))
        self.in_progress_seen.append(LimitedHttpProtocol.in_progress)
        return None if self.decline else Response(b'{"at":"once"}', 200, {"x-seen": str(len(body))}, "application/json")

    async def _app(self, scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.app_calls.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b'{"asgi":1}'})


INFER = "/v2/models/m/infer"


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n" % (path.encode(), len(body), extra) + body


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


def _with_direct(answers: DirectAnswers, scenario) -> object:
    """Run `scenario(reader, writer)` against a real server whose protocol answers through `answers.direct`."""
    saved = LimitedHttpProtocol.direct

    async def run():
        LimitedHttpProtocol.direct = answers.direct
        server, task, port = await _serving(answers.app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await scenario(reader, writer)
            finally:
                writer.close()
        finally:
            server.should_exit = True
            await task

    try:
        return asyncio.run(asyncio.wait_for(run(), 20))
    finally:
        LimitedHttpProtocol.direct = saved


def test_an_inference_request_whose_body_is_in_is_answered_at_once_as_uvicorn_would_and_the_connection_goes_on():
    answers = DirectAnswers()
    before = LimitedHttpProtocol.in_progress

    async def scenario(reader, writer):
        got = []
        for body in (b'{"inputs": 1}', b'{"inputs": 22}'):  # two in turn on one keep-alive connection
            writer.write(_post(INFER, body))
            got.append(await _answer(reader))
        writer.write(_post("/v1/models/m/attention", b"{}"))  # not an inference route: the ASGI app
        got.append(await _answer(reader))
        return got, LimitedHttpProtocol.in_progress

    (first, second, other), in_progress = _with_direct(answers, scenario)
    assert [c[2] for c in answers.direct_calls] == [b'{"inputs": 1}', b'{"inputs": 22}']
    assert answers.app_calls == [("/v1/models/m/attention", b"{}")]
    assert first[0].startswith(b"HTTP/1.1 200 OK\r\n") and first[1] == second[1] == b'{"at":"once"}'
    assert other[1] == b'{"asgi":1}'
    heads = [dict(line.split(b": ", 1) for line in h.split(b"\r\n")[1:] if line) for h, _ in (first, other)]
    assert heads[0][b"x-seen"] == b"13" and heads[0][b"content-type"] == b"application/json"
    assert heads[0][b"server"] == heads[1][b"server"] and b"date" in heads[0]  # uvicorn's default headers, as its own
    assert b"connection" not in heads[0] and in_progress == before


def test_a_request_the_application_declines_or_whose_body_arrives_late_goes_through_the_asgi_app_whole():
    declined = DirectAnswers(decline=True)

    async def one(reader, writer):
        writer.write(_post(INFER, b'{"a": 1}'))
        return await _answer(reader)

    assert _with_direct(declined, one)[1] == b'{"asgi":1}'
    assert [c[2] for c in declined.direct_calls] == [b'{"a": 1}'] and declined.app_calls == [(INFER, b'{"a": 1}')]

    split = DirectAnswers()

    async def in_two_sends(reader, writer):
        request = _post(INFER, b'{"inputs": [1, 2, 3]}')
        writer.write(request[:-5])
        await writer.drain()
        await asyncio.sleep(HOLD_S * 2)  # the head and part of the body arrive alone, the rest after HOLD_S
        writer.write(request[-5:])
        return await _answer(reader)

    assert _with_direct(split, in_two_sends)[1] == b'{"asgi":1}'
    assert split.direct_calls == [] and split.app_calls == [(INFER, b'{"inputs": [1, 2, 3]}')]


def test_a_body_sent_apart_from_its_head_soon_after_is_still_answered_at_once():
    answers = DirectAnswers()

    async def head_then_body(reader, writer):  # as httpx and tritonclient send: two writes
        request = _post(INFER, b'{"inputs": [4]}')
        writer.write(request[:-15])
        await writer.drain()
        await asyncio.sleep(HOLD_S / 10)
        writer.write(request[-15:])
        return await _answer(reader)

    assert _with_direct(answers, head_then_body)[1] == b'{"at":"once"}'
    assert [c[2] for c in answers.direct_calls] == [b'{"inputs": [4]}'] and answers.app_calls == []


def test_pipelined_inference_requests_are_answered_in_order_and_connection_close_closes_after_the_answer():
    """Three requests in one send: the first is answered at once, the two queued behind it by the ASGI app (uvicorn
    starts a pipelined request's task when the one before it is answered), in order; the last asked to close."""
    answers = DirectAnswers()

    async def scenario(reader, writer):
        writer.write(_post(INFER, b"1") + _post(INFER, b"22") + _post(INFER, b"333", b"Connection: close\r\n"))
        got = [await _answer(reader) for _ in range(3)]
        return got, await reader.read()  # then the server closes: EOF

    got, rest = _with_direct(answers, scenario)
    assert [c[2] for c in answers.direct_calls] == [b"1"] and answers.app_calls == [(INFER, b"22"), (INFER, b"333")]
    assert [body for _, body in got] == [b'{"at":"once"}', b'{"asgi":1}', b'{"asgi":1}']
    assert b"connection: close" in got[2][0] and b"connection: close" not in got[0][0] and rest == b""


def test_requests_read_in_the_same_loop_turn_are_all_in_progress_when_the_application_is_asked_about_one():
    """Two clients' requests that arrive together are read in one turn of the event loop: when `direct` is asked
    about the first, the second counts as in progress (so the application does not run them one by one inline),
    and the second, found not alone as it is read, goes straight to the ASGI app."""
    answers = DirectAnswers(decline=True)
    before = LimitedHttpProtocol.in_progress

    async def scenario(reader, writer):
        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", writer.get_extra_info("peername")[1])
        await asyncio.sleep(0.05)  # both connections accepted
        writer.write(_post(INFER, b"1"))
        other_writer.write(_post(INFER, b"2"))  # both sent before the server's loop runs again
        got = [await _answer(reader), await _answer(other_reader)]
        other_writer.close()
        return got

    assert [body for _, body in _with_direct(answers, scenario)] == [b'{"asgi":1}'] * 2
    assert answers.in_progress_seen == [before + 2] and sorted(body for _, body in answers.app_calls) == [b"1", b"2"]


def test_a_body_over_the_limit_is_left_to_the_asgi_app_which_refuses_it():
    answers = DirectAnswers()
    saved = LimitedHttpProtocol.limits
    LimitedHttpProtocol.limits = RequestLimits(max_body_bytes=1024)

    async def scenario(reader, writer):
        writer.write(_post(INFER, b'{"inputs": "%s"}' % (b"x" * 1100)))
        return await _answer(reader)

    try:
        assert _with_direct(answers, scenario)[1] == b'{"asgi":1}'
    finally:
        LimitedHttpProtocol.limits = saved
    assert answers.direct_calls == [] and len(answers.app_calls) == 1
