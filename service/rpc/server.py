"""The ingress replica's gRPC server: the Open Inference Protocol's GRPCInferenceService and grpc.health.v1, on the
replica's event loop (grpc.aio), answering through the same Ingress methods as HTTP: the same models, batching,
limits and metrics (endpoint `grpc_infer`). Typed service errors become gRPC status codes here, in one table.
No torch.
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

if TYPE_CHECKING:
    from service.ingress import Ingress

SERVICE = "inference.GRPCInferenceService"
# HTTP status of a typed error -> gRPC status (OverCapacityError, a 503 in HTTP, is RESOURCE_EXHAUSTED: retry later)
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
T = TypeVar("T")


def status_of(exc: ServiceError) -> grpc.StatusCode:
    if isinstance(exc, OverCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return CODES.get(exc.status, grpc.StatusCode.INTERNAL)


async def answered(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """`work`'s answer; a service error aborts the call with its status and message."""
    try:
        return await work
    except ServiceError as exc:
        await context.abort(status_of(exc), str(exc))
        raise  # abort raises; never reached


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def ServerLive(self, request, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._ingress.not_ready() is None)

    async def ModelReady(self, request, context) -> pb.ModelReadyResponse:
        ready = await answered(context, self._ingress.model_is_ready(request.name, request.version or None))
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self._ingress.server_metadata())

    async def ModelMetadata(self, request, context) -> pb.ModelMetadataResponse:
        from service.rpc.tensors import model_metadata

        metadata = await answered(context, self._ingress.model_metadata(request.name, request.version or None))
        return model_metadata(metadata)

    async def ModelInfer(self, request, context) -> pb.ModelInferResponse:
        return await answered(context, self._ingress.infer_message(request))


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING once every model is ready, NOT_SERVING while loading and once draining."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def Check(self, request, context) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}; ask '' or {SERVICE}")
        ready = await self._ingress.not_ready() is None
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served: poll Check")


class GrpcServer:
    """One grpc.aio server on the running event loop, bound at construction (a port that cannot be had fails the
    replica's start, saying why); messages over limits.max_body_bytes are refused by gRPC itself."""

    def __init__(self, ingress: Ingress, host: str, port: int, limits: RequestLimits) -> None:
        options = [
            ("grpc.max_receive_message_length", limits.max_body_bytes),
            ("grpc.so_reuseport", 0),  # a second server on the port must fail, not share it
        ]
        self._server = grpc.aio.server(options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(ingress), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(ingress), self._server)
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
