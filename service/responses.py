"""JSON responses and the one mapping of errors to HTTP: typed service errors to their status, anything else to 500.

orjson encodes (numpy arrays natively); every error body is `{"error": "..."}`, except under OPENAI_PREFIX, where it is
OpenAI's `{"error": {"message": "...", ...}}` (the same status and message: what its clients read). No torch.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from starlette.responses import Response

from service.errors import ServiceError

JSON = "application/json"
OPENAI_PREFIX = "/openai/"  # OpenAI's wire format lives under this path (KServe's prefix)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, JSON)


def binary_response(header: bytes, data: bytes, header_length_name: str) -> Response:
    """A JSON header followed by raw bytes, the header's length in `header_length_name` (v2's binary extension)."""
    return Response(header + data, 200, {header_length_name: str(len(header))}, "application/octet-stream")


def error_body(message: str, status: int, openai: bool = False) -> dict[str, Any]:
    """`{"error": message}`; `openai`: OpenAI's shape, whose clients show error.message."""
    if not openai:
        return {"error": message}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def is_openai(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def error_response(exc: BaseException, openai: bool = False) -> Response:
    """The HTTP answer to an error raised while handling a request (`openai`: a request under OPENAI_PREFIX)."""
    if isinstance(exc, ServiceError):
        return json_response(error_body(str(exc), exc.status, openai), exc.status, exc.headers())
    return json_response(error_body(f"internal error: {type(exc).__name__}: {exc}", 500, openai), 500)


def raw_error_response(exc: ServiceError, openai: bool = False) -> bytes:
    """The same answer as bytes on the wire, for errors found in the request head before any ASGI app runs; the
    connection closes after it."""
    body = orjson.dumps(error_body(str(exc), exc.status, openai))
    headers = {"content-type": JSON, "content-length": str(len(body)), **(exc.headers() or {}), "Connection": "close"}
    head = [f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
