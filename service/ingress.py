"""The ingress deployment: routes by model name to each model's placement (its engine in this replica, or its own
deployment), validating and tokenizing against the model's metadata; serves the one ASGI application
(service/http/api.py) behind Serve's proxy or on its own port, and the Open Inference Protocol's gRPC service
(service/rpc/server.py) behind Serve's gRPC proxy or on its own port; records request metrics and drains. No torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version as package_version
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from grpc_health.v1 import health_pb2
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from contract.binary_tensors import EXTENSION
from contract.rpc import inference_pb2 as pb
from service import attention_api
from service.coalescer import Coalescer
from service.config import AppConfig
from service.engine import EngineSettings, ModelEngine, ModelStatus
from service.errors import BadRequestError, ModelNotFoundError, NotReadyError, OverCapacityError, ServiceError
from service.http.api import create_app, describe_errors
from service.http.head_limits import body_too_large
from service.http.limits import read_body
from service.http.server import HttpServer
from service.metrics import GAUGE_REFRESH_S, UNKNOWN_MODEL, IngressMetrics, model_labels
from service.placement import Colocated, ModelPlacement, Remote
from service.protocol import binary, simple, v2
from service.responses import binary_response, json_response
from service.routes import ROUTE_KEY, RouteConfigError, RoutePlan, RouteTable
from service.rpc import tensors
from service.rpc.server import Answers, GrpcServer, streamed_through_serve, through_serve
from service.shadow import Agreement, Mirror, ShadowTraffic

logger = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's code for a request whose client closed the connection first (metrics only)
BodyT = TypeVar("BodyT", bound=BaseModel)
AnswerT = TypeVar("AnswerT")  # an HTTP response or a gRPC message


def describe(status: ModelStatus) -> dict[str, Any]:
    """A model's entry in the model list."""
    out: dict[str, Any] = {"name": status.name, "ready": status.ready}
    if status.metadata is not None:
        meta = status.metadata
        out.update(simple.head_config(meta))
        out.update(
            quantized_from=meta.quantized_from,
            max_len=meta.max_len,
            vocab_size=meta.vocab_size,
            labels=list(meta.labels),
            task=meta.task,
        )
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
        raise BadRequestError("invalid request: " + describe_errors(errors)) from None


def _shorten(name: str, limit: int = 80) -> str:
    """A name echoed in an error, cut to `limit` characters (a client can send any length)."""
    return name if len(name) <= limit else name[:limit] + "..."


def _ready(name: str, status: ModelStatus) -> ModelStatus:
    """The status of a ready model; NotReadyError saying why otherwise."""
    if not status.ready:
        raise NotReadyError(f"model {name!r} is not ready: {status.reason}")
    return status


@serve.deployment
@serve.ingress()
class Ingress:
    """Routes by model name to each model's placement: its engine in this process (co-located) or its deployment's
    handle; caches each model's status once it is ready (metadata never changes). With `ingress.port`, serves the
    application on that port itself; Serve's proxy reaches the same application either way."""

    def __init__(self, remote: dict[str, DeploymentHandle], colocated: list[str], config: AppConfig) -> None:
        self._config = config
        self.limits = config.limits
        models: dict[str, ModelPlacement] = {}
        for name in colocated:
            settings = EngineSettings.of(config.settings_for(name), config.backend_for(name), "colocated")
            models[name] = Colocated(ModelEngine(config.models_dir, name, settings))
        for name, handle in remote.items():
            coalescer = None
            if config.ingress.coalesce:
                settings = config.settings_for(name)
                coalescer = Coalescer(name, handle, settings.max_batch_size, settings.max_queued_requests)
            models[name] = Remote(name, handle, coalescer)
        self._models = dict(sorted(models.items()))
        self.model_names = list(self._models)
        self._ready: dict[str, ModelStatus] = {}  # name -> status of a loaded model (metadata never changes)
        self._labels: dict[str, dict[str, str]] = {}  # name -> its metric labels, once loaded
        self._in_flight = 0  # inference requests in progress here, every model (limits.max_in_flight)
        self._draining = False  # set by `drain` on SIGTERM: readiness answers 503 from then on
        self._metrics = IngressMetrics()
        self._gauge_refresher: asyncio.Task | None = None
        self._routes = RouteTable.build(config.routes, self.model_names)
        self._routes_installed = False  # set by the first `reconfigure`: a later invalid one keeps the routes served
        self._shadows = ShadowTraffic(self._run_shadow, self._preempt, self._busy, self._record_shadow)
        self._app = create_app(self)
        ingress = config.ingress
        self._server = None
        if ingress.port is not None:
            self._server = HttpServer(self._app, ingress.host, ingress.port, self.limits, ingress.access_log)
        self._rpc = Answers(self)
        self._grpc = None
        if ingress.grpc_port is not None:
            self._grpc = GrpcServer(self._rpc, ingress.host, ingress.grpc_port, self.limits)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place reconfigure (the deployment's user_config changed, no restart): install its routes whole.
        Requests in progress keep the target they were given. Invalid routes fail a starting replica, saying why;
        a running one logs why and keeps serving the routes it has (Serve would otherwise replace every replica
        with one that cannot start)."""
        try:
            table = RouteTable.build(user_config.get("routes") or {}, self.model_names)
        except RouteConfigError as exc:
            if not self._routes_installed:
                raise
            logger.error("routes not changed: invalid config: %s", exc)
            return
        self._routes, self._routes_installed = table, True
        self._app.openapi_schema = None  # the document names the routes: built again on its next request

    def __serve_build_asgi_app__(self):
        """Serve's hook for an application built by the replica: the one application, for Serve's proxy."""
        return self._app

    def check_health(self) -> None:
        """Serve's health check: the replica's own HTTP and gRPC servers must still be serving."""
        if self._server is not None:
            self._server.check()
        if self._grpc is not None:
            self._grpc.check()

    # ---- drain (the local launcher calls these through a handle) ----
    def drain(self) -> int:
        """Readiness answers 503 from now on (a load balancer stops sending); requests keep being served. Returns
        the inference requests in progress (the launcher waits for them, up to limits.drain_s)."""
        self._draining = True
        return self._in_flight

    def in_flight(self) -> int:
        return self._in_flight

    # ---- model status ----
    def _model(self, name: str) -> ModelPlacement:
        model = self._models.get(name)
        if model is None:
            routes = f"; routes: {self._routes.names}" if self._routes.names else ""
            raise ModelNotFoundError(f"unknown model {_shorten(name)!r}; models: {self.model_names}{routes}")
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

    @staticmethod
    def _check_version(name: str, version: str | None) -> None:
        if version is not None and version != v2.MODEL_VERSION:
            raise ModelNotFoundError(
                f"model {_shorten(name)!r} has no version {version!r}; versions: [{v2.MODEL_VERSION!r}]"
            )

    # ---- inference ----
    async def infer(self, request: Request, name: str, version: str | None = None) -> Response:
        """Open Inference Protocol v2 inference, of a model or a route (answered by one of its targets)."""
        target, route = self._routes.resolve(name, request.headers.get(ROUTE_KEY))

        async def work(status: ModelStatus | None) -> Response:
            self._check_version(name, version)
            self._model(target)  # 404 before the body is read
            raw = await read_body(request, self.limits)
            header, blob = binary.split(raw, request.headers.get(binary.HEADER))
            body = parse_body(header, v2.InferRequest)
            binary.attach(body, blob)
            as_binary = binary.wants_binary(body)
            logits = await self._v2_logits(target, status, body, self._alone(), route)
            if as_binary:
                return binary_response(*binary.infer_response(target, body, logits), binary.HEADER_NAME)
            return json_response(v2.infer_response(target, body, logits))

        return await self._measured("v2_infer", target, work, route)

    async def infer_message(self, message: pb.ModelInferRequest, key: str | None = None) -> pb.ModelInferResponse:
        """Open Inference Protocol inference over gRPC (`key`: the call's routing key): decoded into the same v2
        request, batched and measured the same way. Never run on the event loop: requests waiting inside gRPC are not
        seen by `_alone`."""
        name = message.model_name
        target, route = self._routes.resolve(name, key)

        async def work(status: ModelStatus | None) -> pb.ModelInferResponse:
            self._check_version(name, message.model_version or None)
            self._model(target)
            size = message.ByteSize()  # Serve's gRPC proxy takes up to 2 GiB; the replica's own server, the limit
            if size > self.limits.max_body_bytes:
                raise body_too_large(size, self.limits.max_body_bytes)
            body = tensors.to_request(message)
            logits = await self._v2_logits(target, status, body, False, route)
            return tensors.to_response(target, body, logits)

        return await self._measured("grpc_infer", target, work, route)

    async def _v2_logits(
        self, name: str, status: ModelStatus | None, body: v2.InferRequest, alone: bool, route: RoutePlan | None
    ):
        """A decoded v2 request's logits (B, C) from model `name` (mirrored when its `route` says so)."""
        meta = _ready(name, status).metadata
        v2.requested_outputs(body)
        rows = v2.decode(body, meta, self.limits.max_rows)
        logits = (await self._model(name).infer(rows.ids, rows.mask, alone)).logits
        self._mirror(route, name, rows.ids, rows.mask, logits)
        return logits

    async def predict(self, request: Request, name: str) -> Response:
        """Simple JSON inference, of a model or a route (answered by one of its targets), with the request's
        timing."""
        target, route = self._routes.resolve(name, request.headers.get(ROUTE_KEY))

        async def work(status: ModelStatus | None) -> Response:
            start = time.perf_counter()
            model = self._model(target)  # 404 before the body is read
            body = await self._body(request, simple.PredictRequest)
            status = _ready(target, status)
            rows = simple.decode(body, status.metadata, self.limits.max_rows)
            result = await model.infer(rows.ids, rows.mask, self._alone())
            self._mirror(route, target, rows.ids, rows.mask, result.logits)
            timing = {
                "total_ms": (time.perf_counter() - start) * 1e3,
                "queue_ms": result.queue_s * 1e3,
                "run_ms": result.run_s * 1e3,
                "batch_rows": result.batch_rows,
            }
            return json_response(simple.predict_response(body, status.metadata, status.backend, result.logits, timing))

        return await self._measured("v1_predict", target, work, route)

    async def attention(self, request: Request, name: str) -> Response:
        if (route := self._routes.get(name)) is not None:
            raise ModelNotFoundError(f"{name!r} is a route: attention maps are per model; its targets: {route.targets}")

        async def work(status: ModelStatus | None) -> Response:
            model = self._model(name)  # 404 before the body is read
            body = await self._body(request, attention_api.AttentionRequest)
            meta = _ready(name, status or await self._status(name)).metadata
            ids, tokens = attention_api.decode(body, meta)
            result = await model.attention(ids)
            return json_response(attention_api.response(body, meta, tokens, result))

        return await self._measured("v1_attention", name, work)

    async def _body(self, request: Request, model: type[BodyT]) -> BodyT:
        """The request's JSON body, read within the limits and parsed as `model` (binary tensor data is v2's only)."""
        if binary.HEADER in request.headers:
            raise BadRequestError(f"binary tensor data ({binary.HEADER_NAME}) is for POST /v2/models/{{name}}/infer")
        return parse_body(await read_body(request, self.limits), model)

    def _alone(self) -> bool:
        """Whether the inference request asking is the only request in progress in this replica, counting those
        whose head was read and whose handler has not run yet (its model may then run it on the event loop). Known
        only when this replica serves HTTP itself: requests waiting in Serve's proxy are not seen."""
        server = self._server
        return server is not None and self._in_flight <= 1 and server.requests_in_progress() <= 1

    async def _measured(
        self,
        endpoint: str,
        name: str,
        work: Callable[[ModelStatus | None], Awaitable[AnswerT]],
        route: RoutePlan | None = None,
    ) -> AnswerT:
        """The one place that records request metrics: runs one inference request's `work` with its model's status
        (None for an unknown model), recording latency, status code, rejections, in-flight and the `route` it came
        by, and refusing it when over limits.max_in_flight. A mirrored request's run gives way to it."""
        self._start_gauge_refresher()
        self._shadows.preempt()
        start = time.perf_counter()
        status = await self._status(name) if name in self._models else None
        if status is None:
            labels = model_labels(None, "", UNKNOWN_MODEL)
        else:
            labels = self._labels.get(name) or model_labels(status.metadata, status.backend, name)
        self._metrics.started(labels)
        self._in_flight += 1
        code, rejected = 500, False
        try:
            if self._in_flight > self.limits.max_in_flight:
                raise OverCapacityError(
                    f"the server is over capacity ({self.limits.max_in_flight} inference requests in progress); "
                    "retry later"
                )
            response = await work(status)
            code = getattr(response, "status_code", 200)  # an HTTP response's, else a gRPC answer: OK
            return response
        except ServiceError as exc:  # answered by the application's error mapping (service/http/api.py)
            code, rejected = exc.status, isinstance(exc, OverCapacityError)
            raise
        except asyncio.CancelledError:  # the client went away before its answer: nobody saw a 500
            code = CLIENT_CLOSED
            raise
        finally:
            self._in_flight -= 1
            elapsed = time.perf_counter() - start  # recorded once the answer is out (this task's send is next)
            loop = asyncio.get_running_loop()
            loop.call_soon(self._metrics.finished, labels, endpoint, code, elapsed, rejected)
            if route is not None:
                self._metrics.routed_request(route.name, labels, code)
            if self._in_flight == 0:
                loop.call_soon(self._shadows.idle)  # after the answer, too

    # ---- shadow traffic (service/shadow.py) ----
    def _mirror(self, route: RoutePlan | None, target: str, ids, mask, logits) -> None:
        """Queue a copy of an answered request for its route's shadow, when the route mirrors this one."""
        if route is not None and route.mirrors(target):
            self._shadows.offer(Mirror(route.name, target, route.shadow, ids, mask, logits))

    def _busy(self) -> bool:
        """Whether a client's request is in progress here (including one whose head was read, not yet handled)."""
        server = self._server
        return self._in_flight > 0 or (server is not None and server.requests_in_progress() > 0)

    def _preempt(self, shadow: str) -> None:
        self._models[shadow].preempt()

    async def _run_shadow(self, mirror: Mirror):
        """The shadow's (n, C) logits for a mirrored request, on spare capacity (None: a client came first); raises
        when the shadow cannot take the request (not ready, or beyond its max_len or vocabulary)."""
        meta = _ready(mirror.shadow, await self._status(mirror.shadow)).metadata
        if mirror.ids.shape[1] > meta.max_len or int(mirror.ids.max(initial=0)) >= meta.vocab_size:
            raise BadRequestError(f"the request is beyond shadow model {mirror.shadow!r}'s max_len or vocabulary")
        return await self._models[mirror.shadow].spare_infer(mirror.ids, mirror.mask)

    def _record_shadow(self, mirror: Mirror, outcome: str, agreement: Agreement | None) -> None:
        primary = self._labels.get(mirror.primary) or model_labels(None, "", mirror.primary)
        shadow = self._labels.get(mirror.shadow) or model_labels(None, "", mirror.shadow)
        self._metrics.shadowed(mirror.route, primary, shadow, outcome, agreement)

    def _start_gauge_refresher(self) -> None:
        if self._gauge_refresher is None:
            self._gauge_refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                self._metrics.refresh()
                if self._server is not None:
                    self._server.refresh_metrics()
            except Exception:  # one failed export must not stop the counters and gauges for good
                logger.exception("refreshing the ingress metrics failed; trying again in %g s", GAUGE_REFRESH_S)
            await asyncio.sleep(GAUGE_REFRESH_S)

    # ---- health and metadata ----
    async def not_ready(self) -> str | None:
        """Why the server is not ready (draining, or models not loaded), or None when it is."""
        if self._draining:
            return "shutting down"
        statuses = await asyncio.gather(*(self._status(n, live=True) for n in self._models))
        waiting = {s.name: s.reason for s in statuses if not s.ready}
        return f"models not ready: {waiting}" if waiting else None

    async def ready(self) -> Response:
        why = await self.not_ready()
        return json_response({"ready": True}) if why is None else json_response({"ready": False, "error": why}, 503)

    def server_metadata(self) -> dict[str, Any]:
        version = package_version("mha-serving")
        return {"name": self._config.server_name, "version": version, "extensions": [EXTENSION]}

    @property
    def served_names(self) -> list[str]:
        """What a request may name: every model, then every route."""
        return [*self.model_names, *self._routes.names]

    async def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """v2 metadata of a model; of a route, its heaviest target's under the route's name (targets take the same
        inputs: they serve one task)."""
        self._check_version(name, version)
        route = self._routes.get(name)
        target = route.heaviest if route is not None else name
        return {**v2.model_metadata(_ready(target, await self._status(target)).metadata), "name": name}

    async def model_status(self, name: str, version: str | None = None) -> ModelStatus:
        """A model's status, asked afresh (a route's: ready when each target is); ModelNotFoundError for an unknown
        model or version."""
        self._check_version(name, version)
        route = self._routes.get(name)
        if route is None:
            return await self._status(name, live=True)
        targets = await asyncio.gather(*(self._status(t, live=True) for t in route.targets))
        waiting = {s.name: s.reason for s in targets if not s.ready}
        return ModelStatus(name, not waiting, f"targets not ready: {waiting}" if waiting else "")

    async def model_is_ready(self, name: str, version: str | None = None) -> bool:
        return (await self.model_status(name, version)).ready

    async def model_ready(self, name: str, version: str | None = None) -> Response:
        status = await self.model_status(name, version)
        if not status.ready:
            return json_response({"name": name, "ready": False, "error": status.reason}, 503)
        return json_response({"name": name, "ready": True})

    async def list_models(self) -> dict[str, list[dict[str, Any]]]:
        """Every model with its head configuration, and every route with its targets and shadow."""
        statuses = await asyncio.gather(*(self._status(n, live=True) for n in self._models))
        ready = {s.name for s in statuses if s.ready}
        routes = [r.describe(all(t in ready for t in r.targets)) for r in self._routes.plans.values()]
        return {"models": [describe(s) for s in statuses], "routes": routes}

    # ---- gRPC through Serve's gRPC proxy: it calls the method named after the RPC (service/rpc/server.py) ----
    async def ServerLive(self, request: pb.ServerLiveRequest, grpc_context: RayServegRPCContext):
        return await through_serve(grpc_context, self._rpc.ServerLive(request), pb.ServerLiveResponse)

    async def ServerReady(self, request: pb.ServerReadyRequest, grpc_context: RayServegRPCContext):
        return await through_serve(grpc_context, self._rpc.ServerReady(request), pb.ServerReadyResponse)

    async def ModelReady(self, request: pb.ModelReadyRequest, grpc_context: RayServegRPCContext):
        return await through_serve(grpc_context, self._rpc.ModelReady(request), pb.ModelReadyResponse)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, grpc_context: RayServegRPCContext):
        return await through_serve(grpc_context, self._rpc.ServerMetadata(request), pb.ServerMetadataResponse)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, grpc_context: RayServegRPCContext):
        return await through_serve(grpc_context, self._rpc.ModelMetadata(request), pb.ModelMetadataResponse)

    async def ModelInfer(self, request: pb.ModelInferRequest, grpc_context: RayServegRPCContext):
        metadata = grpc_context.invocation_metadata() or ()
        return await through_serve(grpc_context, self._rpc.ModelInfer(request, metadata), pb.ModelInferResponse)

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context: RayServegRPCContext):
        return await through_serve(grpc_context, self._rpc.Check(request), health_pb2.HealthCheckResponse)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context: RayServegRPCContext):
        """A unary-stream RPC, so a generator for Serve's proxy; it raises, UNIMPLEMENTED, before any answer."""
        await streamed_through_serve(grpc_context, self._rpc.Watch(request))
        yield health_pb2.HealthCheckResponse()  # never reached
