"""A small HTTP/1.1 keep-alive client on asyncio streams: the load tester's hot path.

Measured here against a trivial server, httpx's AsyncClient cost ~25x more CPU per request and collapsed at 32
concurrent requests; on a small machine that measures the client instead of the service.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

_RETRYABLE = (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError)


class HTTPError(Exception):
    """A request that got no HTTP answer; `kind` is what the report counts it as."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes


class _Closed(Exception):
    """The server closed a connection before answering (a reused keep-alive connection may be retried)."""


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)  # CRLF after each chunk


async def _read_response(reader: asyncio.StreamReader) -> tuple[Response, bool]:
    """One response from the stream, and whether the connection can be reused."""
    status_line = await reader.readline()
    if not status_line:
        raise _Closed("the server closed the connection")
    version, status = status_line.split(b" ", 2)[:2]
    length, chunked, keep = None, False, version == b"HTTP/1.1"
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = value == b"keep-alive" or (keep and value != b"close")
    if chunked:
        body = await _read_chunked(reader)
    elif length is not None:
        body = await reader.readexactly(length)
    else:
        body, keep = await reader.read(), False  # until the server closes
    return Response(int(status), body), keep


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

    def request_bytes(self, path: str, body: bytes) -> bytes:
        head = (
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: keep-alive\r\n\r\n" % ((self.prefix + path).encode(), self.host_header, len(body))
        )
        return head + body

    async def _exchange(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], raw: bytes) -> Response:
        reader, writer = conn
        try:
            writer.write(raw)
            await writer.drain()
            response, keep = await _read_response(reader)
        except BaseException:  # timed out, cancelled or broken: this connection is in an unknown state
            writer.close()
            raise
        if keep:
            self._idle.append(conn)
        else:
            writer.close()
        return response

    async def post(self, path: str, body: bytes) -> Response:
        """POST a JSON body; HTTPError when no HTTP answer came (refused, timed out, closed, malformed)."""
        raw = self.request_bytes(path, body)
        try:
            async with asyncio.timeout(self.timeout_s):
                while self._idle:  # a reused connection the server has closed meanwhile: try the next, then a new one
                    conn = self._idle.pop()
                    try:
                        return await self._exchange(conn, raw)
                    except (_Closed, *_RETRYABLE):
                        continue
                return await self._exchange(await self._connect(), raw)
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
