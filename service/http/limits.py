"""Request limits inside the application: an ASGI middleware refusing a head or an announced body over the limits
before any route runs, and the body read within its size and time limits. No torch.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from starlette.middleware import Middleware
from starlette.requests import Request

from service.config import RequestLimits
from service.errors import BodyTimeoutError, ServiceError
from service.http.head_limits import HEAD_CHECKED, body_too_large, head_too_large, too_many_headers
from service.responses import error_response


def over_limits(scope: dict[str, Any], limits: RequestLimits) -> ServiceError | None:
    """The error for a request whose head or announced body is over the limits, before a byte of the body is read.
    The ingress's own server refuses heads as they arrive (service/http/head_limits.py) and marks the scope
    HEAD_CHECKED; this checks what came through Serve's proxy once its head is parsed."""
    headers = scope["headers"]
    if not scope.get(HEAD_CHECKED):
        if len(headers) > limits.max_headers:
            return too_many_headers(limits.max_headers)
        if sum(len(k) + len(v) + 4 for k, v in headers) + len(scope.get("raw_path") or b"") > limits.max_header_bytes:
            return head_too_large(limits.max_header_bytes)
    length = dict(headers).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
        return body_too_large(int(length), limits.max_body_bytes)
    return None


class RequestLimitsMiddleware:
    """Answers a request over the limits (over_limits) with its JSON error; every other request goes on."""

    def __init__(self, app, limits: RequestLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (refusal := over_limits(scope, self.limits)) is not None:
            return await error_response(refusal)(scope, receive, send)
        await self.app(scope, receive, send)


# Serve's documented proxy hook: set where Ray starts (the image, the tests' cluster-like Ray), read by Serve's proxy.
PROXY_LIMITS_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "service.http.limits:proxy_middlewares"}


PROXY_LIMITS_VAR = "MHA_PROXY_LIMITS"  # JSON of RequestLimits fields for Serve's proxy; the defaults otherwise


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback: on a cluster, where requests reach the ingress through Serve's proxy, the proxy
    checks heads and announced bodies against the limits before it reads a body (uvicorn sends `100 Continue` only
    once a body is read). The proxy serves every application: its limits are the defaults or MHA_PROXY_LIMITS."""
    limits = RequestLimits.model_validate_json(os.environ.get(PROXY_LIMITS_VAR) or "{}")
    return [Middleware(RequestLimitsMiddleware, limits=limits)]


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The whole body, refused as soon as more than `max_body_bytes` have arrived, chunked or not (413), or when it
    has not all arrived within `body_timeout_s` (408: a slow client must not hold its slot for long)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise body_too_large(size, limits.max_body_bytes) from None
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(
            f"the request body did not arrive within {limits.body_timeout_s:g} s ({size} bytes read)"
        ) from None
    return b"".join(chunks)
