"""The one ASGI application over the data plane (service/dataplane.py): every route, declared once per protocol; the
one mapping of errors to responses; request limits as middleware. No torch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from service import attention_api, openapi
from service.dataplane import DataPlane
from service.errors import ServiceError
from service.http import generate, inference, metrics_relay, openapi_doc
from service.http import repository as http_repository
from service.http.limits import RequestLimitsMiddleware, over_limits
from service.protocol import simple, v2
from service.protocol.parsing import describe_errors
from service.repository import Repository
from service.responses import error_body, error_response, is_openai, json_response
from service.validation import Bounds

# FastAPI's own OpenTelemetry instrumentation asks the global providers on every request whether it is configured;
# the service's metrics go through Ray's Prometheus export instead.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}


def create_app(plane: DataPlane, repository: Repository | None = None) -> FastAPI:
    description = "Multi-head attention classifiers on ONNX Runtime."
    # The document and its pages are routes of ours: the document states the served models' limits, known once
    # they load (an await), which FastAPI's own synchronous `openapi()` cannot wait for.
    pages = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="mha-serving", description=description, telemetry=NO_TELEMETRY, **pages)
    app.add_middleware(RequestLimitsMiddleware, limits=plane.limits)
    _map_errors(app)
    _inference_routes(app, plane)  # first: the router tries routes in order
    _v2_routes(app, plane)
    _v1_routes(app, plane)
    generate.add_routes(app, plane)
    if repository is not None and repository.enabled:
        http_repository.add_routes(app, repository, plane.metrics, plane.limits)
    openapi_doc.add_routes(app, plane, lambda models, routes, bounds: document(app, models, bounds, routes))
    metrics_relay.add_routes(app)
    return app


def _map_errors(app: FastAPI) -> None:
    """Every error a route raises becomes `{"error": ...}` with its status, in OpenAI's shape under /openai/
    (service/responses.py)."""

    async def mapped(request: Request, exc: Exception) -> Response:
        return error_response(exc, is_openai(request.url.path))

    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        message = "invalid request: " + describe_errors(exc.errors())
        return json_response(error_body(message, 400, is_openai(request.url.path)), 400)

    async def http_error(request: Request, exc: HTTPException) -> Response:  # Starlette's 404 and 405
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names the methods of the first route of the path only
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(app, request.scope))}
        body = error_body(str(exc.detail), exc.status_code, is_openai(request.url.path))
        return json_response(body, exc.status_code, headers)

    # ServiceError's handler answers and the connection stays open; the one for any other Exception (a 500) runs in
    # Starlette's outermost middleware, which answers, then re-raises: the server logs it and closes the connection.
    app.add_exception_handler(ServiceError, mapped)
    app.add_exception_handler(Exception, mapped)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """Every method some route serves on the request's path (Allow of a 405, whichever route matched first)."""
    methods: set[str] = set()
    for route in app.routes:
        if isinstance(route, BaseRoute) and route.matches(scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


@dataclass(frozen=True)
class InferenceRoute:
    """An inference route, declared once: registered as a FastAPI route that documents itself (path parameters,
    body, answer, errors) but answers through `handle`, which reads the path itself, so that FastAPI solves no
    parameters per request on the hottest path; the ingress's own server matches the same registered routes ahead
    of the middleware stack (InferenceFirst)."""

    name: str
    path: str
    handle: Callable[[DataPlane, Request, dict[str, str]], Awaitable[Response]]
    body: type[BaseModel]
    answer: type[BaseModel]


INFERENCE_ROUTES = (
    InferenceRoute(
        "infer",
        "/v2/models/{name}/infer",
        lambda plane, request, path: inference.v2_infer(plane, request, path["name"]),
        v2.InferRequest,
        v2.InferResponse,
    ),
    InferenceRoute(
        "infer_version",
        "/v2/models/{name}/versions/{version}/infer",
        lambda plane, request, path: inference.v2_infer(plane, request, path["name"], path["version"]),
        v2.InferRequest,
        v2.InferResponse,
    ),
    InferenceRoute(
        "predict",
        "/v1/models/{name}/predict",
        lambda plane, request, path: inference.predict(plane, request, path["name"]),
        simple.PredictRequest,
        simple.PredictResponse,
    ),
)


# The path parameters of the inference routes, as FastAPI documents them (no docstring: it would be the description).
def _named(name: str) -> None: ...


def _versioned(name: str, version: str) -> None: ...


class HandledRoute(APIRoute):
    """An APIRoute answered by its InferenceRoute's `handle` (FastAPI's custom route class hook,
    `get_route_handler`) instead of its documented endpoint."""

    def __init__(self, route: InferenceRoute, plane: DataPlane) -> None:
        self.answer, self.plane = route.handle, plane  # not `handle`: Starlette's routes have a method of that name
        binary = route.body is v2.InferRequest
        super().__init__(
            route.path,
            _versioned if "{version}" in route.path else _named,
            methods=["POST"],
            name=route.name,
            openapi_extra=openapi.binary_request() if binary else openapi.request_body(route.body),
            responses=openapi.responses(route.answer, 404, 503, *openapi.WITH_BODY, binary_answer=binary),
        )

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle, plane = self.answer, self.plane

        async def answer(request: Request) -> Response:
            return await handle(plane, request, request.path_params)

        return answer


def _inference_routes(app: FastAPI, plane: DataPlane) -> None:
    app.router.routes.extend(HandledRoute(route, plane) for route in INFERENCE_ROUTES)


class InferenceFirst:
    """The ingress's own server's application: the inference routes (HandledRoute) answered ahead of FastAPI's
    middleware stack and router (the six layers each request otherwise crosses), with the same limits check,
    handlers and error mapping; every other request, and any other method on these paths, goes to `app`."""

    def __init__(self, app: FastAPI, plane: DataPlane) -> None:
        self.app, self.plane = app, plane
        self._routes = [(r.path_regex, r.answer) for r in app.routes if isinstance(r, HandledRoute)]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            for pattern, handle in self._routes:
                if (match := pattern.match(scope["path"])) is not None:
                    return await self._answer(handle, match.groupdict(), scope, receive, send)
        await self.app(scope, receive, send)

    async def _answer(self, handle, path: dict[str, str], scope, receive, send) -> None:
        if (refusal := over_limits(scope, self.plane.limits)) is not None:
            return await error_response(refusal)(scope, receive, send)
        try:
            response = await handle(self.plane, Request(scope, receive, send), path)
        except Exception as exc:
            await error_response(exc)(scope, receive, send)
            if isinstance(exc, ServiceError):
                return
            raise  # a 500, as Starlette's outermost middleware does: answered, then the server logs it and closes
        await response(scope, receive, send)


def _v2_routes(app: FastAPI, plane: DataPlane) -> None:
    """The Open Inference Protocol v2's health and metadata routes."""

    @app.get("/v2/health/live", responses=openapi.responses(v2.Live))
    async def live() -> Response:
        return json_response({"live": True})

    @app.get("/v2/health/ready", responses=openapi.responses(v2.Ready, 503))
    async def ready() -> Response:
        why = await plane.not_ready()
        return json_response({"ready": True}) if why is None else json_response({"ready": False, "error": why}, 503)

    @app.get("/v2", responses=openapi.responses(v2.ServerMetadata))
    async def server_metadata() -> Response:
        return json_response(v2.server_metadata(plane.server_name))

    @app.get("/v2/models/{name}", responses=openapi.responses(v2.ModelMetadataResponse, 404, 503))
    async def model_metadata(name: str) -> Response:
        return await _model_metadata(plane, name)

    @app.get("/v2/models/{name}/versions/{version}", responses=openapi.responses(v2.ModelMetadataResponse, 404, 503))
    async def model_version_metadata(name: str, version: str) -> Response:
        return await _model_metadata(plane, name, version)

    @app.get("/v2/models/{name}/ready", responses=openapi.responses(v2.ModelReady, 404, 503))
    async def model_ready(name: str) -> Response:
        return await _model_ready(plane, name)

    @app.get("/v2/models/{name}/versions/{version}/ready", responses=openapi.responses(v2.ModelReady, 404, 503))
    async def model_version_ready(name: str, version: str) -> Response:
        return await _model_ready(plane, name, version)


async def _model_metadata(plane: DataPlane, name: str, version: str | None = None) -> Response:
    """v2 metadata of a model, or of a route (its heaviest target's, under the route's name)."""
    return json_response({**v2.model_metadata(await plane.metadata(name, version)), "name": name})


async def _model_ready(plane: DataPlane, name: str, version: str | None = None) -> Response:
    status = await plane.model_status(name, version)
    if not status.ready:
        return json_response({"name": name, "ready": False, "error": status.reason}, 503)
    return json_response({"name": name, "ready": True})


def _v1_routes(app: FastAPI, plane: DataPlane) -> None:
    """The simple JSON API's model list and attention (predict is with the inference routes)."""

    @app.get("/v1/models", responses=openapi.responses(simple.ModelList))
    async def list_models() -> Response:
        return json_response(simple.model_list(await plane.listing()))

    @app.post(
        "/v1/models/{name}/attention",
        openapi_extra=openapi.request_body(attention_api.AttentionRequest),
        responses=openapi.responses(attention_api.AttentionResponse, 404, 503, *openapi.WITH_BODY),
    )
    async def attention(name: str, request: Request) -> Response:
        """Per-layer, per-head attention weights of one text (from model.attn.onnx, opened on first use)."""
        return await inference.attention(plane, request, name)


def document(app: FastAPI, models: list[str], bounds: Bounds, route_names: list[str] = ()) -> dict[str, Any]:
    """FastAPI's document of the routes, completed (service/openapi.py) with the request bodies within `bounds`
    (and the model repository API's, where it is mounted) and the names served: `models`, then `route_names`."""
    built = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    bodies = openapi.request_schemas(bounds) | openapi.generation_schemas()
    if any(getattr(r, "path", "").startswith(http_repository.PREFIX) for r in app.routes):
        bodies |= openapi.repository_schemas(models)
    values = {"name": [*models, *route_names], "version": [v2.MODEL_VERSION], "model": models}
    return openapi.completed(built, bodies, values)
