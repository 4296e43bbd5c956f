"""ASGI middleware in front of the FastAPI app: the request limits (the head; the body on Content-Length and again
while reading), and the inference routes (the hot path) dispatched straight to the ingress's handlers, skipping
FastAPI's routing and dependency resolution; every other route, and the OpenAPI document, is FastAPI's. No torch.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from service.config import RequestLimits
from service.errors import BodyTimeoutError, BodyTooLargeError, HeadersTooLargeError, ServiceError
from service.responses import error_response

HEAD_CHECKED = "mha.head_checked"  # scope key set by service/http_server.py: the head was held to the limits already


def route_path(scope: dict[str, Any]) -> str:
    """The request path below the application's route prefix (Serve sets it as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def match_inference(method: str, path: str) -> tuple[str, dict[str, str]] | None:
    """(handler name, path parameters) for POST /v2/models/{name}[/versions/{version}]/infer and
    /v1/models/{name}/predict; None for any other request."""
    if method != "POST":
        return None
    parts = path.split("/")  # "", protocol, "models", name, ...
    if len(parts) < 5 or parts[2] != "models" or not parts[3]:
        return None
    if parts[1] == "v2" and len(parts) == 5 and parts[4] == "infer":
        return "infer", {"name": parts[3]}
    if parts[1] == "v2" and len(parts) == 7 and parts[4] == "versions" and parts[5] and parts[6] == "infer":
        return "infer_version", {"name": parts[3], "version": parts[5]}
    if parts[1] == "v1" and len(parts) == 5 and parts[4] == "predict":
        return "predict", {"name": parts[3]}
    return None


def too_large(size: int, limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"request body of {size} bytes is over the limit of {limit} bytes")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, refused as soon as more than `limit` bytes have arrived, chunked or not (413), or when it has
    not all arrived within `timeout_s` (408: a slow client must not hold its slot for long)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(size, limit) from None
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout_s:g} s ({size} bytes read)") from None
    return b"".join(chunks)


def over_limits(scope: dict[str, Any], limits: RequestLimits) -> ServiceError | None:
    """The error for a request whose head or announced body is over the limits, before a byte of the body is read.
    The HTTP server (service/http_server.py) refuses heads as they arrive and marks the scope HEAD_CHECKED; this
    catches what came through Serve's proxy, which keeps the default limits."""
    headers = scope["headers"]
    if not scope.get(HEAD_CHECKED):
        if len(headers) > limits.max_headers:
            return HeadersTooLargeError(f"more than {limits.max_headers} request headers")
        if sum(len(k) + len(v) + 4 for k, v in headers) + len(scope.get("raw_path") or b"") > limits.max_header_bytes:
            return HeadersTooLargeError(f"request headers are over the limit of {limits.max_header_bytes} bytes")
    length = dict(headers).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
        return too_large(int(length), limits.max_body_bytes)
    return None


class FrontDoor:
    """The app's outermost middleware. The ingress registers itself as `app.state.ingress`, with its
    `app.state.limits`; before it has, every request goes to FastAPI."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["app"].state
        limits = getattr(state, "limits", None)
        refusal = over_limits(scope, limits) if limits is not None else None
        if refusal is not None:
            return await error_response(refusal)(scope, receive, send)
        ingress = getattr(state, "ingress", None)
        route = match_inference(scope["method"], route_path(scope)) if ingress is not None else None
        if route is None:
            return await self.app(scope, receive, send)
        handler, params = route
        try:
            response = await getattr(ingress, handler)(request=Request(scope, receive), **params)
        except Exception as exc:  # the same mapping as FastAPI's exception handlers
            response = error_response(exc)
        await response(scope, receive, send)
