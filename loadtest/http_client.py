"""The project's one HTTP/1.1 client: the load tester's hot path, and the benchmarks' closed-loop load on loopback.

`ConnectionPool`: keep-alive connections on asyncio streams to any origin (TLS, timeouts, reconnects), what
`loadtest` drives. Measured here against a trivial server, httpx's AsyncClient cost ~25x more CPU per request and
collapsed at 32 concurrent requests; on a small machine that measures the client instead of the service.

`load` (with `post_bytes` and `LoadResult`): closed-loop connections to 127.0.0.1, as lean per request as can be, so
on a 2-core machine the client steals as little CPU from the server as possible (`python -m benchmarks.serving`,
tests). One connection runs on a blocking socket: at c=1 the client's own CPU is in every latency.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import urlsplit

import numpy as np

_RETRYABLE = (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError)
OnData = Callable[[bytes], None]  # takes each piece of a streamed body as it arrives


class HTTPError(Exception):
    """A request that got no HTTP answer; `kind` is what the report counts it as."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # by lower-case name


class _Closed(Exception):
    """The server closed a connection before answering (a reused keep-alive connection may be retried)."""


async def _read_chunked(reader: asyncio.StreamReader, on_data: OnData | None = None) -> bytes:
    """A chunked body; with `on_data`, each chunk is handed to it as it arrives instead (and b"" returned)."""
    parts = []
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        chunk = await reader.readexactly(size)
        if on_data is None:
            parts.append(chunk)
        else:
            on_data(chunk)
        await reader.readexactly(2)  # CRLF after each chunk


async def _read_response(reader: asyncio.StreamReader, on_data: OnData | None = None) -> tuple[Response, bool]:
    """One response from the stream, and whether the connection can be reused. With `on_data`, a 200's body is
    handed to it piece by piece as it arrives (a server-sent event stream) and the Response's body is empty."""
    status_line = await reader.readline()
    if not status_line:
        raise _Closed("the server closed the connection")
    version, status = status_line.split(b" ", 2)[:2]
    length, chunked, keep = None, False, version == b"HTTP/1.1"
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        headers[name.decode("latin-1")] = value.decode("latin-1")
        value = value.lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = value == b"keep-alive" or (keep and value != b"close")
    streamed = on_data if int(status) == 200 else None
    if chunked:
        body = await _read_chunked(reader, streamed)
    elif length is not None:
        body = await reader.readexactly(length)
    elif streamed is not None:
        body, keep = b"", False  # until the server closes
        while piece := await reader.read(65536):
            streamed(piece)
    else:
        body, keep = await reader.read(), False  # until the server closes
    if streamed is not None and body:
        streamed(body)
        body = b""
    return Response(int(status), body, headers), keep


class ConnectionPool:
    """Keep-alive connections to one origin, opened as needed (callers bound the concurrency) and reused."""

    def __init__(self, base_url: str, timeout_s: float, tls: ssl.SSLContext | None = None):
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.tls = (tls or ssl.create_default_context()) if self.https else None
        self.host_header = parts.netloc.encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(self.host, self.port, ssl=self.tls)
        except OSError as exc:
            raise HTTPError("connect_error", f"cannot connect to {self.host}:{self.port}: {exc}") from None

    def request_bytes(self, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers).encode("latin-1")
        head = (
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
            b"Connection: keep-alive\r\n\r\n" % ((self.prefix + path).encode(), self.host_header, len(body), extra)
        )
        return head + body

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], raw: bytes, on_data: OnData | None = None
    ) -> Response:
        reader, writer = conn
        try:
            writer.write(raw)
            await writer.drain()
            response, keep = await _read_response(reader, on_data)
        except BaseException:  # timed out, cancelled or broken: this connection is in an unknown state
            writer.close()
            raise
        if keep:
            self._idle.append(conn)
        else:
            writer.close()
        return response

    async def post(
        self, path: str, body: bytes, headers: Sequence[tuple[str, str]] = (), on_data: OnData | None = None
    ) -> Response:
        """POST a JSON body (with `headers` added: a binary body's Inference-Header-Content-Length); HTTPError when no
        HTTP answer came (refused, timed out, closed, malformed). With `on_data`, a 200's body goes to it as it
        arrives (server-sent events), and the timeout bounds the whole stream."""
        raw = self.request_bytes(path, body, headers)
        received = 0

        def counted(piece: bytes) -> None:
            nonlocal received
            received += len(piece)
            on_data(piece)  # type: ignore[misc]

        sink = counted if on_data is not None else None
        try:
            async with asyncio.timeout(self.timeout_s):
                while self._idle:  # a reused connection the server has closed meanwhile: try the next, then a new one
                    conn = self._idle.pop()
                    try:
                        return await self._exchange(conn, raw, sink)
                    except (_Closed, *_RETRYABLE):
                        if received:  # a stream broken midway is not sent again: its first part was measured
                            raise
                        continue
                return await self._exchange(await self._connect(), raw, sink)
        except TimeoutError:
            raise HTTPError("timeout", f"no answer within {self.timeout_s:g} s") from None
        except (_Closed, *_RETRYABLE, ConnectionError) as exc:
            raise HTTPError("connection_closed", f"{exc.__class__.__name__}: {exc}") from None
        except (ValueError, IndexError) as exc:
            raise HTTPError("protocol_error", f"malformed HTTP response: {exc}") from None

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


# The benchmarks' closed-loop load on 127.0.0.1: no timeouts, retries or TLS, and one search per response head
# (`_read_lean_response`: ~1.8 us of CPU per response here against ~5.9 us for `_read_response`'s header-at-a-time
# parse, which `ConnectionPool` needs for any server's framing).


@dataclass(frozen=True)
class LoadResult:
    """What `load` counted within its window: 200s, other statuses, and the 200s' latencies."""

    requests: int
    errors: int  # responses other than 200
    seconds: float
    latencies_s: np.ndarray  # one per successful request

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s.size else float("nan")

    @classmethod
    def within(cls, outcomes: list[tuple[int, float, float]], start: float, deadline: float) -> LoadResult:
        """What of (status, latency, when it ended) ended between `start` and `deadline`: what was still in flight at
        the deadline ended after it, and what ended before `start` was the warm-up."""
        kept = [o for o in outcomes if start <= o[2] <= deadline]
        ok = np.array([t for s, t, _ in kept if s == 200])
        return cls(len(ok), sum(1 for s, _, _ in kept if s != 200), deadline - start, ok)


def post_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 POST of a JSON body to 127.0.0.1 (keep-alive, HTTP/1.1's default), ready to send as is."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _body_length(head: bytes) -> int | None:
    """A response head's Content-Length; None for a chunked body (ValueError for a head with neither)."""
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        return None
    field = b"\r\ncontent-length:"  # at a line's start: not Inference-Header-Content-Length
    start = lower.index(field) + len(field)
    return int(lower[start : lower.index(b"\r\n", start)])


async def _read_lean_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
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


def read_response(stream: BinaryIO) -> tuple[int, bytes]:
    """One HTTP/1.1 answer read from a blocking buffered stream (`socket.makefile("rb")`): its status and body."""
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
            status, _ = await _read_lean_response(reader)
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
            status, _ = read_response(stream)
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
    return LoadResult.within(out, start, deadline)
