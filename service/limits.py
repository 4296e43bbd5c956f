"""Request limits: their settings (RequestLimits, AppConfig's `limits`), enforced here for every transport: the head's
size and header count, the body's size and arrival deadline, rows per request, connections, and inference requests in
progress (generation's own share of them too). Each check raises the typed error that names its limit
(service/errors.py). No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.errors import (
    BadRequestError,
    BodyTimeoutError,
    BodyTooLargeError,
    HeadersTooLargeError,
    OverCapacityError,
    TooManyConnectionsError,
)

HEAD_LINE_BYTES = 4  # ": " and CRLF around each header's name and value
MAX_BODY_BYTES = 1 << 20  # 1 MiB: larger request bodies get 413
MAX_HEADER_BYTES = 64 << 10  # 64 KiB of request line and headers (nginx allows 32 KiB, Node.js 16 KiB)


class RequestLimits(BaseModel):
    """What one request may hold and how long it may take; each refusal is a JSON error naming the limit."""

    model_config = ConfigDict(extra="forbid")
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, description="larger bodies get 413")
    max_header_bytes: int = Field(
        MAX_HEADER_BYTES, ge=1024, description="request line and headers together; more get 431, cut off as they arrive"
    )
    max_headers: int = Field(100, ge=8, description="request headers; more get 431")
    max_rows: int = Field(64, ge=1, description="sequences per request; more get 400")
    body_timeout_s: float = Field(10.0, gt=0, description="the whole body must arrive within this; else 408")
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the request line and headers must arrive within this of the connection's start (on a kept-alive "
        "connection: of the next request's first byte), however they trickle; else 408 and a close. A connection "
        "that sends nothing is closed. Enforced by the ingress's own server (ingress.port; on ingress.grpc_port, "
        "HTTP/2's preface and settings must arrive within it)",
    )
    max_connections: int = Field(
        4096,
        ge=8,
        description="open connections to the ingress's own server (ingress.port); one more is answered 503 with "
        "Retry-After and closed; as many again on ingress.grpc_port, where one more is closed at accept. Keep twice "
        "it well under the replica's file descriptor limit (ulimit -n; 20,000 where it was tested): Ray's own "
        "sockets, the model files and refusals still closing need the rest, and each connection may hold a head of "
        "max_header_bytes",
    )
    send_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a streamed answer (server-sent events, a gRPC stream) whose client takes none of it for this long "
        "is ended: its sequence leaves the batch and its connection is reset (gRPC: the call ends with "
        "DEADLINE_EXCEEDED, and a connection whose peer answers no ping within this long is closed)",
    )
    drain_s: float = Field(
        8.0, ge=0, description="on SIGTERM: readiness 503 at once, requests in progress get this long to finish"
    )
    max_in_flight: int = Field(
        1024, ge=1, description="inference requests in progress per ingress replica, every model; more get 503"
    )
    max_generation_in_flight: int | None = Field(
        None,
        ge=1,
        description="of max_in_flight, the generation requests (each held for its whole stream) in progress per "
        "ingress replica, every decoder; more get 503, so that busy decoders leave the classifiers the rest. At most "
        "max_in_flight (equal: no share kept for classifiers); None: three quarters of it",
    )

    @model_validator(mode="after")
    def _generation_within_in_flight(self) -> RequestLimits:
        if self.max_generation_in_flight is not None and self.max_generation_in_flight > self.max_in_flight:
            raise ValueError(
                f"limits.max_generation_in_flight ({self.max_generation_in_flight}) must be at most "
                f"limits.max_in_flight ({self.max_in_flight}): it is generation's share of it"
            )
        return self

    @property
    def generation_in_flight(self) -> int:
        """Generation's share of max_in_flight: the setting, else three quarters (at least 1)."""
        return self.max_generation_in_flight or max(1, self.max_in_flight * 3 // 4)


def check_header_count(count: int, limits: RequestLimits) -> None:
    if count > limits.max_headers:
        raise HeadersTooLargeError.too_many(limits.max_headers)


def check_head_bytes(size: int, limits: RequestLimits) -> None:
    if size > limits.max_header_bytes:
        raise HeadersTooLargeError.too_large(limits.max_header_bytes)


def check_head(headers: list[tuple[bytes, bytes]], target: bytes, limits: RequestLimits) -> None:
    """A whole parsed head (request target and headers) against the head limits."""
    check_header_count(len(headers), limits)
    check_head_bytes(sum(len(k) + len(v) + HEAD_LINE_BYTES for k, v in headers) + len(target), limits)


def check_body_size(size: int, limits: RequestLimits) -> None:
    if size > limits.max_body_bytes:
        raise BodyTooLargeError(size, limits.max_body_bytes)


def check_announced_body(length: bytes | str | None, limits: RequestLimits) -> None:
    """A body announced (Content-Length) over the limit is refused before a byte of it is read."""
    if length is not None and length.isdigit():
        check_body_size(int(length), limits)


async def read_body(chunks: AsyncIterator[bytes], limits: RequestLimits) -> bytes:
    """The whole body, refused as soon as more than `max_body_bytes` have arrived, chunked or not (413), or when it
    has not all arrived within `body_timeout_s` (408: a slow client must not hold its slot for long)."""
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in chunks:
                size += len(chunk)
                check_body_size(size, limits)
                parts.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(limits.body_timeout_s, size) from None
    return b"".join(parts)


def check_row_count(rows: int, max_rows: int, what: str = "sequences") -> None:
    if rows > max_rows:
        raise BadRequestError(f"{rows} {what} in one request, over the limit of {max_rows}")


def check_connections(open_connections: int, limits: RequestLimits) -> None:
    """`open_connections` counts the one being accepted."""
    if open_connections > limits.max_connections:
        raise TooManyConnectionsError(limits.max_connections)


def check_in_flight(in_flight: int, limits: RequestLimits) -> None:
    """`in_flight` counts the request being admitted."""
    if in_flight > limits.max_in_flight:
        raise OverCapacityError.in_flight(limits.max_in_flight)


def check_generation_in_flight(generating: int, limits: RequestLimits) -> None:
    """`generating` counts the generation request being admitted."""
    if generating > limits.generation_in_flight:
        raise OverCapacityError.generation_in_flight(limits.generation_in_flight)
