"""The model repository API over HTTP (the Open Inference Protocol's model repository extension, Triton's paths and
bodies): index, load, unload; and routes set or removed in place (ours: what a rollout steps through). Mounted only
when the config enables it (404 otherwise, as for any unknown path). Each request's body is read within the request
limits first (413, 408: as on every route, with or without the token), then the token is checked (401), then the
body is parsed (400 naming the field); each is counted by status. No torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import FastAPI, Path, Request, Security
from fastapi.responses import Response
from fastapi.security import APIKeyHeader

from service import openapi
from service.errors import ServiceError
from service.http.limits import read_body
from service.limits import RequestLimits
from service.metrics import IngressMetrics
from service.protocol.parsing import BodyT, parse_body
from service.protocol.repository import (
    RepositoryChanged,
    RepositoryIndex,
    RepositoryIndexRequest,
    RepositoryLoadRequest,
    RepositoryModel,
    RepositoryUnloadRequest,
)
from service.repository import Repository
from service.responses import json_response
from service.route_config import ROUTE_NAME, Route

logger = logging.getLogger(__name__)
PREFIX = "/v2/repository/"
TOKEN_SCHEME = "repositoryToken"  # the document's name for the token's security scheme
TOKEN_DOC = "The model repository API's token (the operator's $MHA_REPOSITORY_TOKEN)."
# Documented, not checked here: the token is checked first, and the route table then refuses a bad name (400)
RouteName = Annotated[str, Path(description="the route's name", json_schema_extra={"pattern": ROUTE_NAME})]


def add_routes(app: FastAPI, repository: Repository, metrics: IngressMetrics, limits: RequestLimits) -> None:
    changed = openapi.responses(RepositoryChanged, 400, 401, 404, 409, *openapi.WITH_BODY)
    # The token as the document's security scheme (Swagger UI asks for it once); checked by _counted, not here
    token = APIKeyHeader(name=repository.header, scheme_name=TOKEN_SCHEME, description=TOKEN_DOC, auto_error=False)
    secured = [Security(token)]

    def counted(action: str, name: str, request: Request) -> contextlib.AbstractAsyncContextManager[bytes]:
        return _counted(repository, metrics, limits, action, name, request)

    @app.post(
        "/v2/repository/index",
        dependencies=secured,
        openapi_extra=openapi.request_body(RepositoryIndexRequest, required=False),
        responses=openapi.responses(RepositoryIndex, 401, *openapi.WITH_BODY),
    )
    async def index(request: Request) -> Response:
        """Every model folder and served model, with its state (READY, or UNAVAILABLE and why)."""
        async with counted("index", "", request) as raw:
            body = _parsed(raw, RepositoryIndexRequest)
            entries = await repository.index(body.ready)
            return json_response([RepositoryModel(**vars(e)).model_dump() for e in entries])

    @app.post(
        "/v2/repository/models/{model}/load",
        dependencies=secured,
        openapi_extra=openapi.request_body(RepositoryLoadRequest, required=False),
        responses=changed,
    )
    async def load(model: str, request: Request) -> Response:
        """Load the model from its folder in every serving process (again, if loaded); answered once all serve it."""
        async with counted("load", model, request) as raw:
            _parsed(raw, RepositoryLoadRequest)  # its parameters: none that changes how a model loads
            await repository.load(model)
            return json_response({})

    @app.post(
        "/v2/repository/models/{model}/unload",
        dependencies=secured,
        openapi_extra=openapi.request_body(RepositoryUnloadRequest, required=False),
        responses=changed,
    )
    async def unload(model: str, request: Request) -> Response:
        """Stop serving the model in every serving process; its requests in progress finish."""
        async with counted("unload", model, request) as raw:
            _parsed(raw, RepositoryUnloadRequest)
            await repository.unload(model)
            return json_response({})

    @app.put(
        "/v2/repository/routes/{route}",
        dependencies=secured,
        openapi_extra=openapi.request_body(Route),
        responses=openapi.responses(RepositoryChanged, 400, 401, *openapi.WITH_BODY),
    )
    async def set_route(route: RouteName, request: Request) -> Response:
        """Set one route (targets by weight, a shadow) in every serving process; answered once all have it."""
        async with counted("route", route, request) as raw:
            await repository.set_route(route, _parsed(raw, Route))
            return json_response({})

    @app.delete(
        "/v2/repository/routes/{route}",
        dependencies=secured,
        responses=openapi.responses(RepositoryChanged, 400, 401, 404, 408),
    )
    async def remove_route(route: RouteName, request: Request) -> Response:
        """Remove one route in every serving process (a body, if any, is read within the limits and ignored)."""
        async with counted("route", route, request):
            await repository.set_route(route, None)
            return json_response({})


@contextlib.asynccontextmanager
async def _counted(
    repository: Repository,
    metrics: IngressMetrics,
    limits: RequestLimits,
    action: str,
    name: str,
    request: Request,
) -> AsyncIterator[bytes]:
    """The body read within the limits, then the token checked; the block runs with the body. Each request is
    counted by status, and every change logged."""
    code = 500
    try:
        raw = await read_body(request, limits)
        repository.authorize(request.headers.get(repository.header))
        yield raw
        code = 200
    except ServiceError as exc:
        code = exc.status
        raise
    finally:
        metrics.repository_request(action, code)
        if action != "index":
            client = request.client.host if request.client else "-"
            logger.warning("repository: %s %r from %s: %d", action, name, client, code)


def _parsed(raw: bytes, model: type[BodyT]) -> BodyT:
    """An optional body: none (Triton's clients send none for a plain load or index) is as `{}`."""
    return parse_body(raw if raw.strip() else b"{}", model)
