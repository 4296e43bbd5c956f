"""A minimal keep-alive HTTP/1.1 load client for the benchmark: cheap per request, so on a 2-core machine the
client steals as little CPU from the server as possible. Loopback only. No torch.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np


@dataclass(frozen=True)
class LoadResult:
    requests: int
    errors: int  # responses other than 200
    seconds: float
    latencies_s: np.ndarray  # one per successful request

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s.size else float("nan")


def post_bytes(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _body_length(head: bytes) -> int | None:
    """A response head's Content-Length; None for a chunked body."""
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        return None
    start = lower.index(b"content-length:") + len(b"content-length:")
    return int(lower[start : lower.index(b"\r\n", start)])


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = _body_length(head)
    if length is None:
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, body
            body += chunk[:-2]
    return status, await reader.readexactly(length)


def _read_response_blocking(stream: BinaryIO) -> tuple[int, bytes]:
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = stream.readline()
        if not line:
            raise ConnectionError("the server closed the connection")
        head += line
    length = _body_length(head)
    if length is None:
        raise ValueError("the one-connection client reads Content-Length bodies only, and this one was chunked")
    return int(head[9:12]), stream.read(length)


async def _worker(port: int, requests: list[bytes], deadline: float, out: list, offset: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = offset
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            writer.write(requests[i % len(requests)])
            status, _ = await _read_response(reader)
            end = time.perf_counter()
            out.append((status, end - start, end))
            i += 1
    finally:
        writer.close()


async def _run(port: int, requests: list[bytes], concurrency: int, deadline: float) -> list:
    out: list[tuple[int, float, float]] = []  # (status, latency, when it ended)
    await asyncio.gather(*[_worker(port, requests, deadline, out, k * 7) for k in range(concurrency)])
    return out


def _one_connection(port: int, requests: list[bytes], deadline: float) -> list:
    """One closed-loop connection on a blocking socket: at c=1 the client's own CPU is in every latency, and an
    event loop's (asyncio's, per request) is what this saves (0.1-0.3 ms per request here, on 2 cores)."""
    out: list[tuple[int, float, float]] = []  # (status, latency, when it ended)
    with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rb") as stream:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        i = 0
        while (start := time.perf_counter()) < deadline:
            sock.sendall(requests[i % len(requests)])
            status, _ = _read_response_blocking(stream)
            end = time.perf_counter()
            out.append((status, end - start, end))
            i += 1
    return out


def load(port: int, requests: list[bytes], concurrency: int, seconds: float, warmup_s: float = 0.0) -> LoadResult:
    """`concurrency` connections, each sending the next request as soon as the last is answered (closed loop), for
    `warmup_s` (not counted) then `seconds`. The rate is what ended within those `seconds` over them (a request in
    flight at either edge is not counted as if it had taken the whole window). One connection runs on a blocking
    socket, several on asyncio."""
    start = time.perf_counter() + warmup_s  # what ends before is not counted: the connections and first batches
    deadline = start + seconds
    if concurrency == 1:
        out = _one_connection(port, requests, deadline)
    else:
        out = asyncio.run(_run(port, requests, concurrency, deadline))
    kept = [o for o in out if start <= o[2] <= deadline]  # what was still in flight at the deadline ended after it
    ok = np.array([t for s, t, _ in kept if s == 200])
    return LoadResult(len(ok), sum(1 for s, _, _ in kept if s != 200), seconds, ok)
