"""The OpenAPI document: request bodies and answers as schemas in components, every status the service answers
documented (errors with the one `{"error": ...}` body), no 422 (never sent: invalid requests get 400). No torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
ERRORS = {
    400: "The request breaks the API or the model's limits (max_len, vocabulary, rows); the error names what.",
    404: "No such model, version or route.",
    405: "The path exists with other methods (listed in Allow).",
    408: "The request body did not all arrive within limits.body_timeout_s.",
    413: "The request body is over limits.max_body_bytes.",
    431: "The request line and headers are over limits.max_header_bytes, or there are more than limits.max_headers.",
    503: "Not ready (loading, broken, shutting down) or over capacity; Retry-After says when to retry, if soon.",
}
ANY_REQUEST = (405, 413, 431)  # the front door answers these before any route runs
WITH_BODY = (400, 408)  # routes that read a JSON body
HEADERS = {
    405: {"Allow": {"description": "The methods of this path.", "required": True, "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}},
}


class ErrorBody(BaseModel):
    """Every error: what went wrong, in one line (503 answers from readiness routes add their fields)."""

    error: str


def responses(ok: type[BaseModel], *errors: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses` for a route: 200 with `ok`, its own `errors` and those any request can get."""
    out: dict[int | str, dict[str, Any]] = {200: {"model": ok, "description": ok.__doc__ or "OK"}}
    for status in sorted({*errors, *ANY_REQUEST}):
        out[status] = {"model": ErrorBody, "description": ERRORS[status]}
        if status in HEADERS:
            out[status]["headers"] = HEADERS[status]
    return out


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route that reads `model` from its body itself (FastAPI does not parse it)."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def completed(document: dict[str, Any], bodies: list[type[BaseModel]], values: dict[str, list[str]]) -> dict:
    """FastAPI's document with the request bodies' schemas added, 422 taken out, and the path parameters' values
    this server has (`values`: parameter name -> the model names, the versions) listed."""
    _, defs = models_json_schema([(m, "validation") for m in bodies], ref_template=REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            for param in operation.get("parameters", []):
                param["schema"] = {"type": "string", "title": param["name"].capitalize()}  # never null in a path
                if values.get(param["name"]):
                    param["schema"]["enum"] = values[param["name"]]
    return document
