"""The HTTP ingress: one FastAPI app with every route (v2 protocol, simple JSON, model list, attention).

It validates and tokenizes requests against each model's metadata, then runs the model where it is placed: its
engine in this replica (co-located) or its own deployment. An inference request goes through the ASGI app, or, alone
in the replica with its body in and its model able to run it inline, is answered at once from the HTTP server's
callback (`Ingress.answer_now`); both parse and answer it with the same code. No torch.
"""

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from contract.metadata import ModelMetadata
from service import attention_api, http_server, openapi
from service.asgi import FrontDoor, match_inference, read_body
from service.batching import BatchResult
from service.coalescer import Coalescer
from service.config import AppConfig
from service.engine import EngineSettings, ModelEngine, ModelStatus
from service.errors import (
    BadRequestError,
    ModelNotFoundError,
    NotReadyError,
    OverCapacityError,
    ServiceError,
)
from service.metrics import GAUGE_REFRESH_S, UNKNOWN_MODEL, IngressMetrics, model_labels
from service.placement import Colocated, ModelPlacement, Remote
from service.protocol import simple, v2
from service.responses import error_response, json_response
from service.validation import Rows

logger = logging.getLogger(__name__)
BINARY_HEADER = "inference-header-content-length"  # tritonclient's binary tensor data
BINARY_HEADER_KEY = BINARY_HEADER.encode()  # as the HTTP server lists it
CLIENT_CLOSED = 499  # nginx's code for a request whose client closed the connection first (metrics only)
BodyT = TypeVar("BodyT", bound=BaseModel)
REQUEST_BODIES = [v2.InferRequest, simple.PredictRequest, attention_api.AttentionRequest]
INFER_DOCS = {
    "openapi_extra": openapi.request_body(v2.InferRequest),
    "responses": openapi.responses(v2.InferResponse, 404, 503, *openapi.WITH_BODY),
}


class ServiceApp(FastAPI):
    """FastAPI with FrontDoor outermost, before FastAPI's own middleware (each layer wraps `send` once more), and
    the OpenAPI document completed (service/openapi.py) with the model names of `state.model_names`."""

    def build_middleware_stack(self):
        return FrontDoor(super().build_middleware_stack())

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            info = {"title": self.title, "version": self.version, "description": self.description}
            document = get_openapi(**info, routes=self.routes)
            values = {"name": getattr(self.state, "model_names", []), "version": [v2.MODEL_VERSION]}
            self.openapi_schema = openapi.completed(document, REQUEST_BODIES, values)
        return self.openapi_schema


# FastAPI's own OpenTelemetry instrumentation (newer FastAPI) asks the global providers on every request whether it is
# configured (~1 % of the ingress's CPU, py-spy); the service's metrics go through Ray's Prometheus export instead.
_NO_OTEL = {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
app = ServiceApp(
    title="mha-serving",
    description="Multi-head attention classifiers on ONNX Runtime in Ray Serve.",
    **(_NO_OTEL if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}),
)


@app.exception_handler(ServiceError)  # typed errors, and below anything unexpected: the mapping in service/responses.py
@app.exception_handler(Exception)
async def _error(_: Request, exc: Exception) -> Response:
    return error_response(exc)


@app.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> Response:
    return json_response({"error": "invalid request: " + _describe_errors(exc.errors())}, 400)


@app.exception_handler(HTTPException)
async def _http_error(_: Request, exc: HTTPException) -> Response:
    return json_response({"error": str(exc.detail)}, exc.status_code, exc.headers)


def _describe(status: ModelStatus) -> dict[str, Any]:
    out: dict[str, Any] = {"name": status.name, "ready": status.ready}
    if status.metadata is not None:
        meta = status.metadata
        out.update(simple.head_config(meta))
        out.update(max_len=meta.max_len, vocab_size=meta.vocab_size, labels=list(meta.labels), task=meta.task)
        out.update(backend=status.backend, backend_reason=status.reason, threads=status.threads)
    else:
        out["error"] = status.reason
    return out


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """The JSON body as `model`, whatever the Content-Type (curl -d sends form-encoded); 400 naming the problem."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            raise BadRequestError(f"malformed JSON body: {errors[0].get('msg', '')}") from None
        raise BadRequestError("invalid request: " + _describe_errors(errors)) from None


def _describe_errors(errors: list) -> str:
    problems = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(problems)


def _shorten(name: str, limit: int = 80) -> str:
    """A name echoed in an error, cut to `limit` characters (a client can send any length)."""
    return name if len(name) <= limit else name[:limit] + "..."


def _ready(name: str, status: ModelStatus) -> ModelStatus:
    """The status of a ready model; NotReadyError saying why otherwise."""
    if not status.ready:
        raise NotReadyError(f"model {name!r} is not ready: {status.reason}")
    return status


def _parsed(raw: bytes, binary: str | None, model: type[BodyT]) -> BodyT:
    """A JSON request body as `model`; `binary`: its binary-data header, which this server refuses."""
    if binary is not None and binary.strip() != str(len(raw)):
        raise BadRequestError("binary tensor data is not supported; send JSON tensor data (binary_data=False)")
    return parse_body(raw, model)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """A request header's value from the HTTP server's (lower-case name, value) list; None if absent."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


@dataclass(frozen=True)
class _Call:
    """An inference request parsed and checked, before its run: where it runs, its rows and how it is answered."""

    model: ModelPlacement
    rows: Rows
    answer: Callable[[BatchResult], Response]


CallMaker = Callable[[str, bytes, str | None, ModelStatus, float], _Call]  # name, body, binary header, status, start
ENDPOINTS = {"infer": "v2_infer", "infer_version": "v2_infer", "predict": "v1_predict"}  # route -> metrics label


@serve.deployment
@serve.ingress(app)
class Ingress:
    """Routes by model name to each model's placement: its engine in this process (co-located) or its deployment's
    handle; caches each model's status once it is ready (metadata never changes)."""

    def __init__(self, remote: dict[str, DeploymentHandle], colocated: list[str], config: AppConfig) -> None:
        self._config = config
        self._models: dict[str, ModelPlacement] = {}
        for name in colocated:
            settings = EngineSettings.of(config.settings_for(name), config.backend_for(name))
            self._models[name] = Colocated(ModelEngine(config.models_dir, name, settings, self._alone_in_progress))
        for name, handle in remote.items():
            coalescer = None
            if config.ingress.coalesce:
                settings = config.settings_for(name)
                coalescer = Coalescer(name, handle, settings.max_batch_size, settings.max_queued_requests)
            self._models[name] = Remote(name, handle, coalescer)
        self._models = dict(sorted(self._models.items()))
        self._ready: dict[str, ModelStatus] = {}  # name -> status of a loaded model (metadata never changes)
        self._labels: dict[str, dict[str, str]] = {}  # name -> its metric labels, once loaded
        self._in_flight = 0  # inference requests in progress here, every model (limits.max_in_flight)
        self._draining = False  # set by `drain` on SIGTERM: readiness answers 503 from then on
        self._metrics = IngressMetrics()
        self._gauge_refresher: asyncio.Task | None = None  # started on the replica's event loop by the first request
        limits = config.limits
        fast_app = app if os.environ.get(http_server.FAST_PATH) == "1" else None  # see service/http_server.py
        # this replica's own server, if any
        http_server.install(limits, watch_disconnects=True, fast_app=fast_app, direct=self.answer_now)
        app.state.limits = limits
        app.state.model_names = list(self._models)  # the OpenAPI document's model names
        app.state.ingress = self  # FrontDoor sends the inference routes straight to this replica's handlers

    def _model(self, name: str) -> ModelPlacement:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFoundError(f"unknown model {_shorten(name)!r}; models: {sorted(self._models)}")
        return model

    async def _status(self, name: str, live: bool = False) -> ModelStatus:
        """The model's status: asked (of its replica, for a deployment) when `live` or until it was ready once."""
        cached = self._ready.get(name)
        if cached is not None and not live:
            return cached
        status = await self._model(name).status()
        if status.ready and name not in self._ready:
            self._ready[name] = status
            self._labels[name] = model_labels(status.metadata, status.backend, name)
            self._metrics.model_info(status.metadata, status.backend)
            self._start_gauge_refresher()
        return status

    def _start_gauge_refresher(self) -> None:
        if self._gauge_refresher is None:
            self._gauge_refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                self._metrics.refresh()
            except Exception:  # one failed export must not stop the counters and gauges for good
                logger.exception("refreshing the ingress metrics failed; trying again in %g s", GAUGE_REFRESH_S)
            await asyncio.sleep(GAUGE_REFRESH_S)

    async def _measured(
        self, endpoint: str, name: str, work: Callable[[ModelStatus | None], Awaitable[Response]]
    ) -> Response:
        """Run one inference request's handler, recording latency, status code, rejections and in-flight.

        The model's status is looked up once, here, and handed to `work` (None for an unknown model): it gives the
        metric labels (the head configuration once loaded, a fixed label for unknown names) and the readiness check.
        """
        self._start_gauge_refresher()
        start = time.perf_counter()
        status = await self._status(name) if name in self._models else None
        if status is None:
            labels = model_labels(None, "", UNKNOWN_MODEL)
        else:  # computed once for a loaded model
            labels = self._labels.get(name) or model_labels(status.metadata, status.backend, name)
        self._metrics.started(labels)
        self._in_flight += 1
        code, rejected = 500, False
        try:
            if self._in_flight > self._config.limits.max_in_flight:
                raise OverCapacityError(
                    f"the server is over capacity ({self._config.limits.max_in_flight} inference requests in "
                    "progress); retry later"
                )
            response = await work(status)
            code = response.status_code
            return response
        except ServiceError as exc:
            code, rejected = exc.status, isinstance(exc, OverCapacityError)
            raise
        except asyncio.CancelledError:  # the client went away before its answer: nobody saw a 500
            code = CLIENT_CLOSED
            raise
        finally:
            self._in_flight -= 1
            elapsed = time.perf_counter() - start  # recorded once the answer is out (this task's send is next)
            asyncio.get_running_loop().call_soon(self._metrics.finished, labels, endpoint, code, elapsed, rejected)

    def _alone_in_progress(self, handled: int = 1) -> bool:
        """Whether the inference request asking is the only request in progress in this replica, counting those
        whose bytes were read and whose handler has not started yet (a co-located model may then run it on the
        event loop: service/batching.py); `handled`: whether the asking request is counted in `_in_flight` (its
        handler runs under `_measured`). Only when this replica serves HTTP itself (direct ingress): through
        Serve's proxy, requests queued for the event loop are not seen, and nothing runs inline."""
        arrived = http_server.requests_in_progress()
        return arrived is not None and arrived <= 1 and self._in_flight <= handled

    async def _ready_model(self, name: str, status: ModelStatus | None = None) -> ModelStatus:
        """The status of a ready model (asked for unless given); NotReadyError saying why otherwise."""
        return _ready(name, status or await self._status(name))

    async def _body(self, request: Request, model: type[BodyT]) -> BodyT:
        return _parsed(await self._raw_body(request), request.headers.get(BINARY_HEADER), model)

    async def _raw_body(self, request: Request) -> bytes:
        limits = self._config.limits
        return await read_body(request, limits.max_body_bytes, limits.body_timeout_s)

    @staticmethod
    def _check_version(name: str, version: str | None) -> None:
        if version is not None and version != v2.MODEL_VERSION:
            raise ModelNotFoundError(
                f"model {_shorten(name)!r} has no version {version!r}; versions: [{v2.MODEL_VERSION!r}]"
            )

    # ---- inference, first: Serve names each request's route (for its own metrics) by trying the routes in
    # order, ~1.5 us each (py-spy); no two routes overlap, so the order changes no answer ----
    @app.post("/v2/models/{name}/infer", **INFER_DOCS)
    async def infer(self, name: str, request: Request) -> Response:
        return await self._awaited("infer", {"name": name}, request)

    @app.post("/v2/models/{name}/versions/{version}/infer", **INFER_DOCS)
    async def infer_version(self, name: str, version: str, request: Request) -> Response:
        return await self._awaited("infer_version", {"name": name, "version": version}, request)

    @app.post(
        "/v1/models/{name}/predict",
        openapi_extra=openapi.request_body(simple.PredictRequest),
        responses=openapi.responses(simple.PredictResponse, 404, 503, *openapi.WITH_BODY),
    )
    async def predict(self, name: str, request: Request) -> Response:
        return await self._awaited("predict", {"name": name}, request)

    # An inference request is parsed and checked by one function per route (below), then either awaited (the
    # ASGI path: body read as it arrives, the run batched) or answered at once (`answer_now`).
    def _v2_call(self, name: str, raw: bytes, binary: str | None, status: ModelStatus, start: float) -> _Call:
        model = self._model(name)
        body = _parsed(raw, binary, v2.InferRequest)
        meta: ModelMetadata = _ready(name, status).metadata
        v2.requested_outputs(body)
        rows = v2.decode(body, meta, self._config.limits.max_rows)
        return _Call(model, rows, lambda result: json_response(v2.infer_response(name, body, result.logits)))

    def _predict_call(self, name: str, raw: bytes, binary: str | None, status: ModelStatus, start: float) -> _Call:
        model = self._model(name)
        body = _parsed(raw, binary, simple.PredictRequest)
        status = _ready(name, status)
        rows = simple.decode(body, status.metadata, self._config.limits.max_rows)

        def answer(result: BatchResult) -> Response:
            timing = {
                "total_ms": (time.perf_counter() - start) * 1e3,
                "queue_ms": result.queue_s * 1e3,
                "run_ms": result.run_s * 1e3,
                "batch_rows": result.batch_rows,
            }
            return json_response(simple.predict_response(body, status.metadata, status.backend, result.logits, timing))

        return _Call(model, rows, answer)

    def _call_for(self, route: str, params: dict[str, str]) -> CallMaker:
        """The call maker of an inference route; 404 for a model version that is not served."""
        if route == "predict":
            return self._predict_call
        self._check_version(params["name"], params.get("version"))
        return self._v2_call

    async def _awaited(self, route: str, params: dict[str, str], request: Request) -> Response:
        """An inference request through the ASGI app: 404s before its body is read, then parse, batch, answer."""
        name = params["name"]

        async def work(status: ModelStatus | None) -> Response:
            start = time.perf_counter()
            make = self._call_for(route, params)
            self._model(name)  # 404 before looking at the body; a known model has a status
            raw = await self._raw_body(request)
            call = make(name, raw, request.headers.get(BINARY_HEADER), status, start)
            return call.answer(await call.model.infer(call.rows.ids, call.rows.mask))

        return await self._measured(ENDPOINTS[route], name, work)

    def answer_now(self, method: str, path: str, headers: list[tuple[bytes, bytes]], raw: bytes) -> Response | None:
        """An inference request whose body has all arrived, answered at once on the event loop when nothing else is
        in progress in this replica and its model is co-located, loaded and can run it inline (service/batching.py):
        no task, no ASGI app, no await. None when it cannot: the request then takes the ASGI path, which does it
        all again (a rare waste: only a request whose run turned out too long for an inline run). Called by this
        replica's HTTP server (service/http_server.py); recorded in the metrics as the ASGI path records it."""
        route = match_inference(method, path)
        if route is None or not self._alone_in_progress(0):
            return None
        name = route[1]["name"]
        status, labels = self._ready.get(name), self._labels.get(name)
        if status is None or labels is None or self._models[name].placement != "colocated":
            return None
        start = time.perf_counter()
        rejected = False
        try:
            call = self._call_for(*route)(name, raw, _header(headers, BINARY_HEADER_KEY), status, start)
            result = call.model.infer_now(call.rows.ids, call.rows.mask)
            if result is None:
                return None
            response = call.answer(result)
        except Exception as exc:  # the ASGI path's mapping (FrontDoor), and its metrics (_measured)
            response, rejected = error_response(exc), isinstance(exc, OverCapacityError)
        self._metrics.started(labels)
        elapsed = time.perf_counter() - start  # recorded once the answer is out, as `_measured` does
        finished = (labels, ENDPOINTS[route[0]], response.status_code, elapsed, rejected)
        asyncio.get_running_loop().call_soon(self._metrics.finished, *finished)
        return response

    # ---- Open Inference Protocol v2 ----
    @app.get("/v2/health/live", responses=openapi.responses(v2.Live))
    async def live(self) -> Response:
        return json_response({"live": True})

    def drain(self) -> int:
        """Readiness answers 503 from now on (a load balancer stops sending); requests keep being served. Returns
        the inference requests in progress (the launcher waits for them, up to limits.drain_s)."""
        self._draining = True
        return self._in_flight

    def in_flight(self) -> int:
        return self._in_flight

    @app.get("/v2/health/ready", responses=openapi.responses(v2.Ready, 503))
    async def ready(self) -> Response:
        if self._draining:
            return json_response({"ready": False, "error": "shutting down"}, 503)
        statuses = await asyncio.gather(*(self._status(n, live=True) for n in self._models))
        waiting = {s.name: s.reason for s in statuses if not s.ready}
        if waiting:
            return json_response({"ready": False, "error": f"models not ready: {waiting}"}, 503)
        return json_response({"ready": True})

    @app.get("/v2", responses=openapi.responses(v2.ServerMetadata))
    async def server_metadata(self) -> Response:
        from importlib.metadata import version

        return json_response({"name": self._config.server_name, "version": version("mha-serving"), "extensions": []})

    @app.get("/v2/models/{name}", responses=openapi.responses(v2.ModelMetadataResponse, 404, 503))
    async def model_metadata(self, name: str) -> Response:
        status = await self._ready_model(name)
        return json_response(v2.model_metadata(status.metadata))

    @app.get("/v2/models/{name}/versions/{version}", responses=openapi.responses(v2.ModelMetadataResponse, 404, 503))
    async def model_version_metadata(self, name: str, version: str) -> Response:
        self._check_version(name, version)
        return await self.model_metadata(name)

    @app.get("/v2/models/{name}/ready", responses=openapi.responses(v2.ModelReady, 404, 503))
    async def model_ready(self, name: str) -> Response:
        status = await self._status(name, live=True)
        if not status.ready:
            return json_response({"name": name, "ready": False, "error": status.reason}, 503)
        return json_response({"name": name, "ready": True})

    @app.get("/v2/models/{name}/versions/{version}/ready", responses=openapi.responses(v2.ModelReady, 404, 503))
    async def model_version_ready(self, name: str, version: str) -> Response:
        self._check_version(name, version)
        return await self.model_ready(name)

    # ---- simple JSON ----
    @app.get("/v1/models", responses=openapi.responses(simple.ModelList))
    async def list_models(self) -> Response:
        statuses = await asyncio.gather(*(self._status(n, live=True) for n in self._models))
        return json_response({"models": [_describe(s) for s in statuses]})

    @app.post(
        "/v1/models/{name}/attention",
        openapi_extra=openapi.request_body(attention_api.AttentionRequest),
        responses=openapi.responses(attention_api.AttentionResponse, 404, 503, *openapi.WITH_BODY),
    )
    async def attention(self, name: str, request: Request) -> Response:
        """Per-layer, per-head attention weights of one text (from model.attn.onnx, opened on first use)."""

        async def work(status: ModelStatus | None) -> Response:
            model = self._model(name)  # 404 before looking at the body
            body = await self._body(request, attention_api.AttentionRequest)
            meta: ModelMetadata = (await self._ready_model(name, status)).metadata
            ids, tokens = attention_api.decode(body, meta)
            result = await model.attention(ids)
            return json_response(attention_api.response(body, meta, tokens, result))

        return await self._measured("v1_attention", name, work)


# FastAPI's documentation routes last, behind the ingress's (see the inference routes above).
_DOCS = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
app.router.routes.sort(key=lambda route: getattr(route, "path", None) in _DOCS)
