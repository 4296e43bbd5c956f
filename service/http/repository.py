"""The model repository API over HTTP (the Open Inference Protocol's model repository extension, Triton's paths and
bodies): index, load, unload; and routes set or removed in place (ours: what a rollout steps through). Mounted only
when the config enables it (404 otherwise, as for any unknown path); each request needs the token header first
(401), and is counted by status. No torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from service import openapi
from service.config import Route
from service.errors import BadRequestError, ServiceError
from service.http.inference import describe_errors
from service.inference import MODEL_VERSION
from service.metrics import IngressMetrics
from service.repository import Repository
from service.responses import json_response

logger = logging.getLogger(__name__)
UNSUPPORTED_LOAD = ("config", "file:")  # Triton's overrides: a model is loaded from its folder as exported


class RepositoryModel(BaseModel):
    """One model of the repository index: READY (served) or UNAVAILABLE (unloaded, or why it cannot serve)."""

    name: str
    version: str = MODEL_VERSION
    state: str
    reason: str = ""


class RepositoryIndexRequest(BaseModel):
    """The index's body, optional: `ready` lists the served models only."""

    ready: bool = False


class RepositoryChanged(BaseModel):
    """The model is loaded (or unloaded) in every serving process."""


def add_routes(app: FastAPI, repository: Repository, metrics: IngressMetrics) -> None:
    changed = openapi.responses(RepositoryChanged, 400, 401, 404, 409, *openapi.WITH_BODY)

    @app.post(
        "/v2/repository/index",
        openapi_extra=openapi.request_body(RepositoryIndexRequest),
        responses=openapi.responses(RepositoryModel, 401, *openapi.WITH_BODY),
    )
    async def index(request: Request) -> Response:
        """Every model folder and served model, with its state (READY, or UNAVAILABLE and why)."""
        async with _counted(repository, metrics, "index", "", request):
            ready_only = (await _body(request)).get("ready", False)
            if not isinstance(ready_only, bool):
                raise BadRequestError(f"`ready` must be true or false, got {ready_only!r}")
            entries = await repository.index(ready_only)
            return json_response([RepositoryModel(**vars(e)).model_dump() for e in entries])

    @app.post("/v2/repository/models/{name}/load", responses=changed)
    async def load(name: str, request: Request) -> Response:
        """Load the model from its folder in every serving process (again, if loaded); answered once all serve it."""
        async with _counted(repository, metrics, "load", name, request):
            parameters = (await _body(request)).get("parameters") or {}
            overrides = [k for k in parameters if k == UNSUPPORTED_LOAD[0] or k.startswith(UNSUPPORTED_LOAD[1])]
            if overrides:
                raise BadRequestError(
                    f"load parameters {overrides} are not supported: a model is loaded from its folder as exported"
                )
            await repository.load(name)
            return json_response({})

    @app.post("/v2/repository/models/{name}/unload", responses=changed)
    async def unload(name: str, request: Request) -> Response:
        """Stop serving the model in every serving process; its requests in progress finish."""
        async with _counted(repository, metrics, "unload", name, request):
            await _body(request)
            await repository.unload(name)
            return json_response({})

    @app.put(
        "/v2/repository/routes/{name}",
        openapi_extra=openapi.request_body(Route),
        responses=openapi.responses(RepositoryChanged, 400, 401, *openapi.WITH_BODY),
    )
    async def set_route(name: str, request: Request) -> Response:
        """Set one route (targets by weight, a shadow) in every serving process; answered once all have it."""
        async with _counted(repository, metrics, "route", name, request):
            try:
                route = Route.model_validate(await _body(request))
            except ValidationError as exc:
                raise BadRequestError(f"invalid route: {describe_errors(exc.errors())}") from None
            await repository.set_route(name, route)
            return json_response({})

    @app.delete("/v2/repository/routes/{name}", responses=openapi.responses(RepositoryChanged, 401, 404))
    async def remove_route(name: str, request: Request) -> Response:
        """Remove one route in every serving process."""
        async with _counted(repository, metrics, "route", name, request):
            await repository.set_route(name, None)
            return json_response({})


@contextlib.asynccontextmanager
async def _counted(
    repository: Repository, metrics: IngressMetrics, action: str, name: str, request: Request
) -> AsyncIterator[None]:
    """Authorize first, then run the block; count the request by status and log every load and unload."""
    code = 500
    try:
        repository.authorize(request.headers.get(repository.header))
        yield
        code = 200
    except ServiceError as exc:
        code = exc.status
        raise
    finally:
        metrics.repository_request(action, code)
        if action != "index":
            client = request.client.host if request.client else "-"
            logger.warning("repository: %s %r from %s: %d", action, name, client, code)


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object of the body, {} when empty (Triton's clients send none for the index)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    return body
