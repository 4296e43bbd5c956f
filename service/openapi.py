"""The OpenAPI document: request bodies and answers as schemas in components, every status the service answers
documented (errors with the one `{"error": ...}` body), no 422 (never sent: invalid requests get 400). No torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.attention_api import AttentionRequest
from service.protocol import binary, repository, simple, v2
from service.route_config import Route
from service.validation import Bounds, Schema

REF = "#/components/schemas/{model}"
ERRORS = {
    400: "The request breaks the API or the model's limits (max_len, vocabulary, rows); the error names what.",
    401: "The model repository API's token is missing or wrong.",
    404: "No such model, version or route.",
    405: "The path exists with other methods (listed in Allow).",
    408: "The request body did not all arrive within limits.body_timeout_s.",
    409: "The change conflicts with the configuration (a route targets the model, or it has its own deployment).",
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

BINARY_BODY = {"type": "string", "contentMediaType": "application/octet-stream"}  # OpenAPI 3.1's raw bytes


class ErrorBody(BaseModel):
    """Every error: what went wrong, in one line (503 answers from readiness routes add their fields)."""

    error: str


class OpenAIError(BaseModel):
    message: str
    type: str
    param: None = None
    code: int


class OpenAIErrorBody(BaseModel):
    """Every error under /openai/: OpenAI's shape (service/responses.py), the message as elsewhere."""

    error: OpenAIError


def responses(
    ok: type[BaseModel], *errors: int, binary_answer: bool = False, event_stream: bool = False, openai: bool = False
) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses` for a route: 200 with `ok` (or, `binary_answer`, as binary tensor data; `event_stream`:
    also as server-sent events), its own `errors` and those any request can get (`openai`: in OpenAI's shape)."""
    out: dict[int | str, dict[str, Any]] = {200: {"model": ok, "description": ok.__doc__ or "OK"}}
    if event_stream:
        out[200]["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    if binary_answer:
        length = {"description": "Binary answers only: the length of the JSON header.", "schema": {"type": "string"}}
        out[200]["content"] = {"application/octet-stream": {"schema": BINARY_BODY}}
        out[200]["headers"] = {binary.HEADER_NAME: length}
    for status in sorted({*errors, *ANY_REQUEST}):
        out[status] = {"model": OpenAIErrorBody if openai else ErrorBody, "description": ERRORS[status]}
        if status in HEADERS:
            out[status]["headers"] = HEADERS[status]
    return out


def request_body(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """`openapi_extra` of a route that reads `model` from its body itself (FastAPI does not parse it); its schema is
    one of those `request_schemas` or `repository_schemas` add to the document."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def binary_request() -> dict[str, Any]:
    """`openapi_extra` of v2 infer: the JSON body, or the binary tensor data extension's (a JSON header of
    `Inference-Header-Content-Length` bytes, InferRequestHeader, then the inputs' raw bytes)."""
    header = {
        "name": binary.HEADER_NAME,
        "in": "header",
        "required": False,
        "description": "Binary tensor data: the length in bytes of the body's JSON header (InferRequestHeader); 0, "
        "as no header, means the whole body is JSON (InferRequest).",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
    extra = request_body(v2.InferRequest)
    raw = BINARY_BODY | {"description": "The JSON header (InferRequestHeader), then each binary input's bytes."}
    extra["requestBody"]["content"]["application/octet-stream"] = {"schema": raw}
    return extra | {"description": binary.DESCRIPTION, "parameters": [header]}


def request_schemas(bounds: Bounds) -> dict[str, Schema]:
    """Every request body's schema (and its parts), within the served models' `bounds`."""
    _, defs = models_json_schema([(AttentionRequest, "validation")], ref_template=REF)
    attention = defs["$defs"]["AttentionRequest"]
    text = bounds.text_schema() if bounds.text else False  # a model that takes token ids only refuses every text
    attention["properties"] |= {"text": text, "layer": {"anyOf": [bounds.layer(), {"type": "null"}]}}
    v2_schemas = v2.request_schemas(bounds, REF)
    return {**v2_schemas, "PredictRequest": simple.request_schema(bounds), "AttentionRequest": attention}


def generation_schemas() -> dict[str, Schema]:
    """The generation routes' request bodies (and their parts): OpenAI's completions, the OIP generate."""
    from service.protocol import chat, generate, openai  # the engine's modules: loaded with the routes that use them

    bodies = [(openai.CompletionRequest, "validation"), (chat.ChatCompletionRequest, "validation")]
    bodies += [(generate.GenerateBody, "validation")]
    _, defs = models_json_schema(bodies, ref_template=REF)
    return defs["$defs"]


def repository_schemas(models: list[str]) -> dict[str, Schema]:
    """The model repository API's request bodies (and their parts), a route's models named among `models`."""
    _, defs = models_json_schema([(m, "validation") for m in (*repository.REQUEST_BODIES, Route)], ref_template=REF)
    schemas = defs["$defs"]
    if models:  # a route names served models only: any other is a 400 (service/routes.py)
        schemas["Route"]["properties"]["targets"]["propertyNames"] = {"enum": models}
        schemas["Shadow"]["properties"]["model"]["enum"] = models
    return schemas


def completed(document: dict[str, Any], bodies: dict[str, Schema], values: dict[str, list[str]]) -> dict:
    """FastAPI's document with the request bodies' schemas (`bodies`, by component name) added, 422 taken out, and
    the path parameters' values this server has (`values`: parameter name -> the model names, the versions)
    listed."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(bodies)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            for param in operation.get("parameters", []):
                if param["in"] != "path":
                    continue
                pattern = param.get("schema", {}).get("pattern")
                param["schema"] = {"type": "string", "title": param["name"].capitalize()}  # never null in a path
                if pattern is not None:
                    param["schema"]["pattern"] = pattern
                if values.get(param["name"]):
                    param["schema"]["enum"] = values[param["name"]]
    return document
