"""Request limits (service.config.RequestLimits), enforced here for every transport: the head's size and header
count, the body's size and arrival deadline, rows per request, connections and inference requests in progress.
Each check raises the typed error that names its limit (service/errors.py). No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from service.config import RequestLimits
from service.errors import (
    BadRequestError,
    BodyTimeoutError,
    BodyTooLargeError,
    HeadersTooLargeError,
    OverCapacityError,
    TooManyConnectionsError,
)

HEAD_LINE_BYTES = 4  # ": " and CRLF around each header's name and value


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
