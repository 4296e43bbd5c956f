"""The benchmark's load client against a real HTTP server on loopback: one connection on a blocking socket, several
on asyncio, both counting only what ended within the window."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from service.bench_client import load, post_bytes


class Handler(BaseHTTPRequestHandler):
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


@contextlib.contextmanager
def http_server(chunked: bool):
    """A keep-alive HTTP/1.1 server on loopback answering 200 to the body "ok" and 400 to anything else."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.chunked = chunked  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(("concurrency", "chunked"), [(1, False), (4, False), (4, True)])
def test_load_counts_answers_and_errors_within_the_window(concurrency, chunked):
    requests = [post_bytes("/x", b"ok"), post_bytes("/x", b"ok"), post_bytes("/x", b"bad")]
    with http_server(chunked) as port:
        result = load(port, requests, concurrency, seconds=0.5, warmup_s=0.1)
    assert result.requests > 0 and result.errors > 0  # one request in three answers 400
    assert result.requests == pytest.approx(2 * result.errors, rel=0.2, abs=2 * concurrency)
    assert result.latencies_s.size == result.requests and (result.latencies_s > 0).all()
    assert result.latencies_s.max() < 0.5  # nothing from the warm-up or after the window is in it
    assert result.rate == result.requests / 0.5


def test_one_connection_refuses_a_chunked_body_saying_so():
    with http_server(chunked=True) as port, pytest.raises(ValueError, match="Content-Length bodies only"):
        load(port, [post_bytes("/x", b"ok")], 1, seconds=0.2)
