"""Slow request heads against the service as shipped (`mha-serving serve`, the ingress replica's own server, with
limits.header_timeout_s 2 s and limits.max_connections 50): a head trickled a line every 0.5 s is cut with a JSON 408,
a silent connection is closed, more slow connections than the cap leave a probe client answered, and the ingress
replica's descriptors return to their idle count. Loopback only; each test prints what it measured. The counting
itself: tests/test_head_limits.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import numpy as np
import pytest

from benchmarks.harness.processes import fd_count
from benchmarks.harness.server import ServerProcess
from benchmarks.harness.sockets import tcp_sockets

pytestmark = [pytest.mark.serve, pytest.mark.slow]
HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 50
SLOW_CONNECTIONS = 80  # more than the cap
PREDICT = "/v1/models/mha-h2-d32/predict"


@pytest.fixture(scope="module")
def server(tiny_models_dir):
    limits = {"header_timeout_s": HEADER_TIMEOUT_S, "max_connections": MAX_CONNECTIONS}
    with ServerProcess({"models_dir": str(tiny_models_dir), "backend": "cpu", "limits": limits}) as running:
        yield running


async def _slow_head(port: int) -> tuple[bytes, float]:
    """A request head sent a header line every 0.5 s until the server closes: what it answered, and the seconds
    from connecting to the close."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n")

    async def trickle() -> None:
        for i in range(100):
            await asyncio.sleep(0.5)
            if reader.at_eof() or writer.is_closing():
                return
            writer.write(b"X-Slow-%d: v\r\n" % i)

    trickling = asyncio.create_task(trickle())
    answer = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), HEADER_TIMEOUT_S + 5):
            answer += chunk
    finally:
        trickling.cancel()
        writer.close()
    return answer, time.perf_counter() - start


def _error(answer: bytes, status: int) -> tuple[bytes, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status) and b"application/json" in head, answer[:300]
    return head.lower(), json.loads(body)["error"]


def test_a_head_trickled_a_line_every_half_second_gets_a_json_408_and_a_close_at_header_timeout_s(server):
    answer, seconds = asyncio.run(_slow_head(server.port))
    head, error = _error(answer, 408)
    print(f"\ntrickled head: 408 and close after {seconds:.2f} s (header_timeout_s {HEADER_TIMEOUT_S:g})")
    assert b"connection: close" in head and error.startswith("the request head did not arrive within 2 s (")
    assert HEADER_TIMEOUT_S <= seconds < HEADER_TIMEOUT_S + 1


def test_a_connection_that_sends_nothing_is_closed_at_header_timeout_s(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=HEADER_TIMEOUT_S + 5) as sock:
        start = time.perf_counter()
        answer = sock.recv(64)
        seconds = time.perf_counter() - start
    print(f"\nsilent connection: closed after {seconds:.2f} s")
    assert answer == b"" and seconds < HEADER_TIMEOUT_S + 1


def _connections_on(pid: int, port: int) -> int:
    """TCP connections of process `pid` on local port `port` (its listening socket left out)."""
    return sum(s.port == port and not s.listening for s in tcp_sockets([pid]))


def test_more_slow_heads_than_max_connections_leave_a_probe_answered_and_descriptors_return(server):
    """80 slow heads against a cap of 50: those past the cap are refused at once (503), the others cut at
    header_timeout_s (408); a probe client on its kept-alive connection is answered throughout, and a new
    connection is accepted once the slow ones are gone."""
    pid = server.replica_pid("ingress")
    base = f"http://127.0.0.1:{server.port}"

    async def scenario() -> tuple[list[tuple[bytes, float]], list[tuple[int, float]], int, int]:
        async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
            assert (await probe.post(PREDICT, json={"text": "warm"})).status_code == 200  # its connection: open
            idle = fd_count(pid)
            slow = asyncio.gather(*(_slow_head(server.port) for _ in range(SLOW_CONNECTIONS)))
            answered = []
            while not slow.done():
                start = time.perf_counter()
                code = (await probe.post(PREDICT, json={"text": "still there?"})).status_code
                answered.append((code, time.perf_counter() - start))
                await asyncio.sleep(0.02)
            cut = await slow
        async with httpx.AsyncClient(base_url=base, timeout=10) as fresh:  # a new connection: room under the cap
            answered.append(((await fresh.get("/v2/health/live")).status_code, 0.0))
        return cut, answered, idle, fd_count(pid)

    cut, answered, idle, at_end = asyncio.run(asyncio.wait_for(scenario(), 30))
    deadline = time.monotonic() + 5
    while (left := _connections_on(pid, server.port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = fd_count(pid)
    statuses = [int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else answer[:20] for answer, _ in cut]
    refused = [s for (answer, s), status in zip(cut, statuses, strict=True) if status == 503]
    timed_out = [s for (answer, s), status in zip(cut, statuses, strict=True) if status == 408]
    latencies = np.array([s for _, s in answered[:-1]]) * 1e3
    print(
        f"\n{SLOW_CONNECTIONS} slow heads, cap {MAX_CONNECTIONS}: {len(refused)} refused 503 (slowest close "
        f"{max(refused):.2f} s), {len(timed_out)} cut 408 (slowest close {max(timed_out):.2f} s); probe "
        f"{len(latencies)} requests, p50 {np.percentile(latencies, 50):.1f} ms, p99 {np.percentile(latencies, 99):.1f} "
        f"ms, max {latencies.max():.1f} ms; ingress descriptors: {idle} idle, {at_end} at the end, {after} after"
    )
    assert [code for code, _ in answered] == [200] * len(answered)
    assert sorted(set(statuses)) == [408, 503], statuses
    assert len(refused) >= SLOW_CONNECTIONS - MAX_CONNECTIONS + 1  # the probe holds one place under the cap
    for answer, _ in cut:
        if answer.startswith(b"HTTP/1.1 503"):
            head, error = _error(answer, 503)
            assert b"retry-after: 1" in head and error == "the server holds its limit of 50 connections; retry later"
    assert max(timed_out) < HEADER_TIMEOUT_S + 1
    assert left == 0 and after <= idle, (left, idle, after)
