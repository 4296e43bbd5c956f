"""The HTTP/1.1 client against small real servers on 127.0.0.1: the load tester's pool (framing, keep-alive,
failures), and the benchmarks' closed-loop `load` (one connection on a blocking socket, several on asyncio, both
counting only what ended within the window)."""

from __future__ import annotations

import asyncio
import socket
from http.server import BaseHTTPRequestHandler

import pytest
from loopback_http import http_server

from loadtest.http_client import ConnectionPool, HTTPError, load, post_bytes


class Server:
    """An asyncio HTTP server whose answer to each request is chosen by the request's path."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[str, bytes]] = []
        self.heads: list[list[str]] = []  # each request's header lines

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                self.heads.append(lines[1:])
                path = lines[0].split(" ")[1]
                length = next(int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length"))
                body = await reader.readexactly(length)
                self.requests.append((path, body))
                if not await self.answer(path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def answer(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write the response; False to close the connection afterwards."""
        if path.endswith("/chunked"):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        elif path.endswith("/close"):
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 17\r\n\r\n")
            writer.write(b'{"error":"busy"} ')
            return False
        elif path.endswith("/hang"):
            await asyncio.sleep(10)
        elif path.endswith("/drop"):
            return False  # close without answering
        elif path.endswith("/answer-then-close"):  # as a server whose keep-alive timeout fires right after
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            return False
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return True


async def serve(test) -> None:
    server = Server()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        await test(server, f"http://127.0.0.1:{port}/prefix")


def test_keep_alive_reuses_one_connection_and_echoes_bodies():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=5)
        for i in range(5):
            response = await pool.post("/echo", b'{"i":%d}' % i)
            assert (response.status, response.body) == (200, b'{"i":%d}' % i)
        await pool.aclose()
        assert server.connections == 1 and [p for p, _ in server.requests] == ["/prefix/echo"] * 5

    asyncio.run(serve(test))


def test_extra_header_fields_are_sent_and_the_answers_fields_are_read_by_lower_case_name():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=5)
        response = await pool.post("/echo", b"abc", [("Inference-Header-Content-Length", "2")])
        plain = await pool.post("/echo", b"abcd")
        await pool.aclose()
        assert (
            "Inference-Header-Content-Length: 2" in server.heads[0]
            and "Content-Type: application/json" in server.heads[0]
        )
        assert not any(line.startswith("Inference-Header") for line in server.heads[1])
        assert (response.headers["content-length"], plain.headers["content-length"]) == ("3", "4")

    asyncio.run(serve(test))


def test_concurrent_requests_open_one_connection_each():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=5)
        bodies = [b"%d" % i for i in range(8)]
        responses = await asyncio.gather(*(pool.post("/echo", b) for b in bodies))
        assert [r.body for r in responses] == bodies
        await pool.aclose()
        assert server.connections == 8

    asyncio.run(serve(test))


def test_chunked_bodies_and_connection_close_are_read_and_the_next_request_reconnects():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=5)
        assert (await pool.post("/chunked", b"{}")).body == b"hello world"
        closed = await pool.post("/close", b"{}")
        assert closed.status == 503 and closed.body == b'{"error":"busy"} '
        assert (await pool.post("/echo", b"x")).body == b"x"
        await pool.aclose()
        assert server.connections == 2

    asyncio.run(serve(test))


def test_a_kept_connection_the_server_closed_meanwhile_is_replaced_without_an_error():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=5)
        assert (await pool.post("/answer-then-close", b"a")).body == b"ok"
        await asyncio.sleep(0.05)
        assert (await pool.post("/echo", b"b")).body == b"b"
        await pool.aclose()
        assert server.connections == 2 and [b for _, b in server.requests] == [b"a", b"b"]

    asyncio.run(serve(test))


def test_a_server_that_closes_instead_of_answering_is_a_closed_connection():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=5)
        with pytest.raises(HTTPError) as info:
            await pool.post("/drop", b"{}")
        assert info.value.kind == "connection_closed"
        await pool.aclose()

    asyncio.run(serve(test))


def test_no_answer_in_time_is_a_timeout():
    async def test(server, url):
        pool = ConnectionPool(url, timeout_s=0.2)
        with pytest.raises(HTTPError) as info:
            await pool.post("/hang", b"{}")
        assert info.value.kind == "timeout"
        await pool.aclose()

    asyncio.run(serve(test))


def test_a_port_nobody_listens_on_is_a_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def test():
        with pytest.raises(HTTPError) as info:
            await ConnectionPool(f"http://127.0.0.1:{port}", timeout_s=5).post("/x", b"{}")
        assert info.value.kind == "connect_error"

    asyncio.run(test())


# The benchmarks' `load`, against http.server (threads, one per connection).


class Handler(BaseHTTPRequestHandler):
    """200 to the body "ok", 400 to anything else, on a kept-alive connection; chunked when the server says so."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        status = 200 if body == b"ok" else 400
        self.send_response(status)
        if self.server.chunked:  # type: ignore[attr-defined]
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"2\r\n{}\r\n0\r\n\r\n")
        else:
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(("concurrency", "chunked"), [(1, False), (4, False), (4, True)])
def test_load_counts_answers_and_errors_within_the_window(concurrency, chunked):
    requests = [post_bytes("/x", b"ok"), post_bytes("/x", b"ok"), post_bytes("/x", b"bad")]
    with http_server(Handler, chunked=chunked) as port:
        result = load(port, requests, concurrency, seconds=0.5, warmup_s=0.1)
    assert result.requests > 0 and result.errors > 0  # one request in three answers 400
    assert result.requests == pytest.approx(2 * result.errors, rel=0.2, abs=2 * concurrency)
    assert result.latencies_s.size == result.requests and (result.latencies_s > 0).all()
    assert result.latencies_s.max() < 0.5  # nothing from the warm-up or after the window is in it
    assert result.rate == result.requests / 0.5


def test_one_connection_refuses_a_chunked_body_saying_so():
    with http_server(Handler, chunked=True) as port, pytest.raises(ValueError, match="Content-Length bodies only"):
        load(port, [post_bytes("/x", b"ok")], 1, seconds=0.2)
