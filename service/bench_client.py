"""A minimal keep-alive HTTP/1.1 load client for the benchmark: cheap per request, so on a 2-core machine the
client steals as little CPU from the server as possible. Loopback only. No torch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

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


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, body
            body += chunk[:-2]
    start = lower.index(b"content-length:") + len(b"content-length:")
    length = int(lower[start : lower.index(b"\r\n", start)])
    return status, await reader.readexactly(length)


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


async def _run(port: int, requests: list[bytes], concurrency: int, seconds: float, warmup_s: float) -> LoadResult:
    out: list[tuple[int, float, float]] = []  # (status, latency, when it ended)
    start = time.perf_counter() + warmup_s  # what ends before is not counted: the connections and first batches
    deadline = start + seconds
    workers = [_worker(port, requests, deadline, out, k * 7) for k in range(concurrency)]
    await asyncio.gather(*workers)
    kept = [o for o in out if start <= o[2] <= deadline]  # what was still in flight at the deadline ended after it
    ok = np.array([t for s, t, _ in kept if s == 200])
    return LoadResult(len(ok), sum(1 for s, _, _ in kept if s != 200), seconds, ok)


def load(port: int, requests: list[bytes], concurrency: int, seconds: float, warmup_s: float = 0.0) -> LoadResult:
    """`concurrency` connections, each sending the next request as soon as the last is answered (closed loop), for
    `warmup_s` (not counted) then `seconds`. The rate is what ended within those `seconds` over them (a request in
    flight at either edge is not counted as if it had taken the whole window)."""
    return asyncio.run(_run(port, requests, concurrency, seconds, warmup_s))
