"""The request limits (service/limits.py) on the ASGI side: a middleware refusing a head or an announced body over
the limits before any route runs (where Serve's server parsed the head), one holding an early answer until the body is
in, Serve's proxy hook installing both, and a Starlette request's body read within the limits. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from starlette.middleware import Middleware
from starlette.requests import Request

from service import limits as check
from service.config import RequestLimits
from service.errors import ServiceError
from service.http.coalesced_writes import LINGER_S
from service.http.uvicorn_adapter import HEAD_CHECKED
from service.responses import error_response, is_openai


def over_limits(scope: dict[str, Any], limits: RequestLimits) -> ServiceError | None:
    """The error for a request whose head or announced body is over the limits, before a byte of the body is read.
    The ingress's own server refuses heads as they arrive (service/http/uvicorn_adapter.py) and marks the scope
    HEAD_CHECKED; this checks what came through Serve's proxy once its head is parsed."""
    headers = scope["headers"]
    try:
        if not scope.get(HEAD_CHECKED):
            check.check_head(headers, scope.get("raw_path") or b"", limits)
        check.check_announced_body(dict(headers).get(b"content-length"), limits)
    except ServiceError as refusal:
        return refusal
    return None


class RequestLimitsMiddleware:
    """Answers a request over the limits (over_limits) with its JSON error (OpenAI's shape under its prefix); every
    other request goes on."""

    def __init__(self, app, limits: RequestLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (refusal := over_limits(scope, self.limits)) is not None:
            return await error_response(refusal, is_openai(scope["path"]))(scope, receive, send)
        await self.app(scope, receive, send)


class AnswerAfterBody:
    """Holds an answer given before the request's body is all in (a refusal) until the rest of the body is read and
    dropped, for up to LINGER_S: HAProxy (Serve's HAProxy ingress) closes the client's connection once the answer is
    out, and a client still sending its body (Python's http.client, requests) then gets a broken pipe, not the answer.
    A client waiting on `Expect: 100-continue` has sent none of it and is answered at once."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _has_body(scope["headers"]):
            return await self.app(scope, receive, send)
        read_any = body_in = False

        async def tracked_receive():
            nonlocal read_any, body_in
            message = await receive()
            read_any = True
            body_in = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def held_send(message) -> None:
            if message["type"] == "http.response.start" and not body_in and (read_any or not _expects(scope)):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LINGER_S):
                        while not body_in:
                            await tracked_receive()
            await send(message)

        await self.app(scope, tracked_receive, held_send)


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    return any((k == b"content-length" and v != b"0") or k == b"transfer-encoding" for k, v in headers)


def _expects(scope) -> bool:
    return any(k == b"expect" and v.lower() == b"100-continue" for k, v in scope["headers"])


# Serve's documented proxy hook: set where Ray starts (the image, the tests' cluster-like Ray), read by Serve's proxy.
PROXY_LIMITS_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "service.http.limits:proxy_middlewares"}


PROXY_LIMITS_VAR = "MHA_PROXY_LIMITS"  # JSON of RequestLimits fields for Serve's proxy; the defaults otherwise


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback, which Serve installs around the application in its HTTP proxy and in each ingress
    replica's own Serve server (where HAProxy forwards on a cluster): heads and announced bodies are checked against
    the limits before a body is read (uvicorn sends `100 Continue` only once a body is read), and an early answer
    waits for the body. These serve every application: their limits are the defaults or MHA_PROXY_LIMITS."""
    limits = RequestLimits.model_validate_json(os.environ.get(PROXY_LIMITS_VAR) or "{}")
    # Serve applies them in order, each around the ones before: the last is outermost.
    return [Middleware(RequestLimitsMiddleware, limits=limits), Middleware(AnswerAfterBody)]


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The request's whole body, within max_body_bytes and body_timeout_s (413, 408)."""
    return await check.read_body(request.stream(), limits)
