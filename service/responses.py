"""JSON responses and the one mapping of errors to HTTP: typed service errors to their status, anything else to 500.

orjson encodes (numpy arrays natively); every error body is `{"error": "..."}`. No torch.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from service.errors import ServiceError

JSON = "application/json"


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, JSON)


def error_response(exc: BaseException) -> Response:
    """The HTTP answer to an error raised while handling a request."""
    if isinstance(exc, ServiceError):
        return json_response({"error": str(exc)}, exc.status, exc.headers())
    return json_response({"error": f"internal error: {type(exc).__name__}: {exc}"}, 500)
