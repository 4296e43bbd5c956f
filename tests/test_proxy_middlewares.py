"""Serve's proxy hook (service/http/limits.py proxy_middlewares), wrapped around an application as Serve wraps it, on a
real uvicorn on loopback: a body over the limit is answered 413 only once the client has sent it all (HAProxy, in
front of the replicas' own servers on a cluster, closes a connection once its answer is out, and a client still
sending then gets a broken pipe); a client waiting on `Expect: 100-continue` is answered at once; a client that
stops sending is answered after LINGER_S; and a 64 MiB chunked body through the real Serve proxy. The same through
HAProxy itself: tests/test_deploy_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import uvicorn
from serving import serve_command

from service.http.coalesced_writes import LINGER_S
from service.http.limits import proxy_middlewares
from service.limits import MAX_BODY_BYTES
from service.local.ports import free_port

OVER = MAX_BODY_BYTES + 1  # the proxy's limits are the defaults here


async def _first_chunk_then_413(scope, receive, send) -> None:
    """An application refusing a body after its first chunk (as a chunked body over the limit is refused)."""
    await receive()
    await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


@contextlib.asynccontextmanager
async def _served(app):
    for middleware in proxy_middlewares():  # as Serve applies them: each around the ones before
        app = middleware.cls(app, *middleware.args, **middleware.kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def _answer_after(port: int, head: bytes, parts: list[bytes], wait_s: float) -> tuple[bytes, bytes]:
    """(what arrived within `wait_s` of the head and the first of `parts`, the whole answer after the rest)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + (parts[0] if parts else b""))
    early = b""
    with contextlib.suppress(TimeoutError):
        early = await asyncio.wait_for(reader.read(65536), wait_s)
    for part in parts[1:]:
        writer.write(part)
        await writer.drain()
    answer = early + await asyncio.wait_for(reader.readuntil(b"}"), 10) if b"}" not in early else early
    writer.close()
    return early, answer


def _post(length: int | None, extra: bytes = b"") -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n" + framing + extra + b"\r\n"


def test_a_body_announced_over_the_limit_is_answered_413_only_once_the_client_has_sent_it_all():
    async def scenario():
        async with _served(_first_chunk_then_413) as port:
            body = b"\0" * OVER
            return await _answer_after(port, _post(OVER), [body[: OVER // 2], body[OVER // 2 :]], wait_s=0.5)

    early, answer = asyncio.run(scenario())
    assert early == b""
    assert answer.startswith(b"HTTP/1.1 413") and b"over the limit of %d bytes" % MAX_BODY_BYTES in answer, answer


def test_an_applications_early_answer_waits_for_the_rest_of_a_chunked_body():
    async def scenario():
        async with _served(_first_chunk_then_413) as port:
            chunk = b"%x\r\n%s\r\n" % (65536, b"\0" * 65536)
            return await _answer_after(port, _post(None), [chunk, chunk * 3 + b"0\r\n\r\n"], wait_s=0.5)

    early, answer = asyncio.run(scenario())
    assert early == b""
    assert answer.startswith(b"HTTP/1.1 413"), answer


def test_a_client_waiting_on_100_continue_is_answered_413_at_once_without_100_continue():
    async def scenario():
        async with _served(_first_chunk_then_413) as port:
            return await _answer_after(port, _post(OVER, b"Expect: 100-continue\r\n"), [], wait_s=5)

    early, _ = asyncio.run(scenario())
    assert early.startswith(b"HTTP/1.1 413") and b"100 Continue" not in early, early


def test_a_client_that_stops_sending_its_body_is_answered_after_the_linger():
    async def scenario():
        async with _served(_first_chunk_then_413) as port:
            started = time.monotonic()
            early, _ = await _answer_after(port, _post(OVER), [b"\0" * 1000], wait_s=LINGER_S + 5)
            return early, time.monotonic() - started

    early, took_s = asyncio.run(scenario())
    assert early.startswith(b"HTTP/1.1 413"), early
    assert took_s >= LINGER_S * 0.9, took_s  # held for the body meanwhile, not answered at once


@pytest.mark.serve
@pytest.mark.slow
def test_a_64_mib_chunked_body_through_serves_proxy_is_sent_whole_and_answered_with_a_readable_413(
    tiny_models_dir, tmp_path
):
    """The real `mha-serving serve --proxy`: Serve's HTTP proxy with these middlewares in front of the ingress."""
    port, metrics_port = free_port(), free_port()
    args = ["--models", str(tiny_models_dir), "--proxy", "--port", str(port), "--grpc-port", "0"]
    log = tmp_path / "log"
    with (
        serve_command([*args, "--metrics-port", str(metrics_port), "--num-cpus", "2"], log),
        socket.create_connection(("127.0.0.1", port), timeout=30) as sock,
    ):
        sock.sendall(_post(None).replace(b"/v2/models/m/", b"/v2/models/mha-h2-d32/"))
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        for _ in range(1024):  # 64 MiB, all sent before reading, as Python's http.client sends a body
            sock.sendall(chunk)
        sock.sendall(b"0\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413") and b"over the limit of %d bytes" % MAX_BODY_BYTES in answer, answer
