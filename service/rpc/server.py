"""The Open Inference Protocol's GRPCInferenceService and grpc.health.v1, answered by the Ingress whichever way a call
comes in: the ingress replica's own grpc.aio server (`GrpcServer`, the local direct mode) or Serve's gRPC proxy (on
every node of a cluster; it calls the Ingress's method named after the RPC). `Answers` computes each answer once,
through the same Ingress methods as HTTP (models, batching, limits, metrics with endpoint `grpc_infer`); typed
service errors become gRPC status codes here, in one table. No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from service.config import RequestLimits
from service.errors import OverCapacityError, ServiceError
from service.routes import ROUTE_KEY
from service.rpc.tensors import model_metadata

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

    from service.ingress import Ingress

SERVICE = "inference.GRPCInferenceService"
# grpc_options.grpc_servicer_functions of Serve's gRPC proxy: the services it takes calls for
SERVE_SERVICERS = [
    "contract.rpc.inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
# HTTP status of a typed error -> gRPC status (OverCapacityError, a 503 in HTTP, is RESOURCE_EXHAUSTED: retry later)
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
T = TypeVar("T")


class UnknownServiceError(ServiceError):
    """404: a health check of a service this server does not serve."""

    status = 404


class NotServedError(ServiceError):
    """501: an RPC this server does not serve."""

    status = 501


def route_key(metadata) -> str | None:
    """A call's routing key (service/routes.py ROUTE_KEY) from its invocation metadata (key, value) pairs."""
    for key, value in metadata:
        if key == ROUTE_KEY:
            return value if isinstance(value, str) else None
    return None


def status_of(exc: ServiceError) -> grpc.StatusCode:
    if isinstance(exc, OverCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return CODES.get(exc.status, grpc.StatusCode.INTERNAL)


class Answers:
    """Each RPC's answer, from the Ingress; a typed service error where there is none."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def ServerLive(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._ingress.not_ready() is None)

    async def ModelReady(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self._ingress.model_is_ready(request.name, request.version or None))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self._ingress.server_metadata())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        return model_metadata(await self._ingress.model_metadata(request.name, request.version or None))

    async def ModelInfer(self, request: pb.ModelInferRequest, metadata=()) -> pb.ModelInferResponse:
        """`metadata`: the call's invocation metadata (its routing key, for a route)."""
        return await self._ingress.infer_message(request, route_key(metadata))

    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """SERVING once every model is ready, NOT_SERVING while loading and once draining."""
        if request.service not in ("", SERVICE):
            raise UnknownServiceError(f"unknown service {request.service!r}; ask '' or {SERVICE}")
        ready = await self._ingress.not_ready() is None
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest) -> None:
        raise NotServedError("Watch is not served: poll Check")


async def aborting(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """`work`'s answer; a service error aborts the call with its status and message (the replica's own server)."""
    try:
        return await work
    except ServiceError as exc:
        await context.abort(status_of(exc), str(exc))
        raise  # abort raises; never reached


def _set_status(grpc_context: RayServegRPCContext, exc: ServiceError) -> None:
    grpc_context.set_code(status_of(exc))
    grpc_context.set_details(str(exc))


async def through_serve(grpc_context: RayServegRPCContext, work: Awaitable[T], empty: type[T]) -> T:
    """`work`'s answer for Serve's gRPC proxy; for a service error, an `empty` answer with the error's status and
    message set on Serve's context, which the proxy sends instead (raising would log each refusal as a failure)."""
    try:
        return await work
    except ServiceError as exc:
        _set_status(grpc_context, exc)
        return empty()


async def streamed_through_serve(grpc_context: RayServegRPCContext, work: Awaitable[None]) -> None:
    """`work` for a streaming RPC through Serve's gRPC proxy, which sends a stream's status only when the stream
    raises: a service error's status and message are set on Serve's context, then it is raised again."""
    try:
        await work
    except ServiceError as exc:
        _set_status(grpc_context, exc)
        raise


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, answers: Answers) -> None:
        self._answers = answers

    async def ServerLive(self, request, context) -> pb.ServerLiveResponse:
        return await aborting(context, self._answers.ServerLive(request))

    async def ServerReady(self, request, context) -> pb.ServerReadyResponse:
        return await aborting(context, self._answers.ServerReady(request))

    async def ModelReady(self, request, context) -> pb.ModelReadyResponse:
        return await aborting(context, self._answers.ModelReady(request))

    async def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        return await aborting(context, self._answers.ServerMetadata(request))

    async def ModelMetadata(self, request, context) -> pb.ModelMetadataResponse:
        return await aborting(context, self._answers.ModelMetadata(request))

    async def ModelInfer(self, request, context) -> pb.ModelInferResponse:
        return await aborting(context, self._answers.ModelInfer(request, context.invocation_metadata() or ()))


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, answers: Answers) -> None:
        self._answers = answers

    async def Check(self, request, context) -> health_pb2.HealthCheckResponse:
        return await aborting(context, self._answers.Check(request))

    async def Watch(self, request, context):
        await aborting(context, self._answers.Watch(request))


class GrpcServer:
    """One grpc.aio server on the running event loop, bound at construction (a port that cannot be had fails the
    replica's start, saying why); messages over limits.max_body_bytes are refused by gRPC itself."""

    def __init__(self, answers: Answers, host: str, port: int, limits: RequestLimits) -> None:
        options = [
            ("grpc.max_receive_message_length", limits.max_body_bytes),
            ("grpc.so_reuseport", 0),  # a second server on the port must fail, not share it
        ]
        self._server = grpc.aio.server(options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(answers), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(answers), self._server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"the ingress cannot listen for gRPC on {address}: {exc}") from exc
        self._task = asyncio.get_running_loop().create_task(self._server.start())

    def check(self) -> None:
        """Raise if the server failed to start (Serve's health check then replaces the replica)."""
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise RuntimeError(f"the ingress's gRPC server stopped: {self._task.exception()!r}")
