"""Every RPC the service answers, each declared once: the Open Inference Protocol's GRPCInferenceService and
grpc.health.v1's Health, answered from the data plane whichever way a call comes in (the replica's own gRPC
server, service/rpc/server.py, or Serve's gRPC proxy, service/rpc/serve_proxy.py). No torch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from contract.rpc import inference_pb2 as pb
from service.dataplane import DataPlane, Endpoint
from service.errors import NotServedError, UnknownServiceError
from service.limits import check_body_size
from service.protocol import v2
from service.routes import ROUTE_KEY
from service.rpc import tensors

INFERENCE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
GRPC_INFER = Endpoint("grpc_infer")  # not counted from arrival: calls waiting inside gRPC are not seen
Metadata = Sequence[tuple[str, Any]]  # a call's invocation metadata: (key, value) pairs
Answer = Callable[[DataPlane, Any, Metadata], Awaitable[Message | None]]


@dataclass(frozen=True)
class Rpc:
    service: str  # the full service name
    name: str  # the method name, as gRPC and Serve's proxy call it
    request: type[Message]
    response: type[Message]
    answer: Answer  # raises a ServiceError where there is no answer
    streaming: bool = False  # unary-stream


def route_key(metadata: Metadata) -> str | None:
    """A call's routing key (service/routes.py ROUTE_KEY) from its invocation metadata."""
    for key, value in metadata:
        if key == ROUTE_KEY:
            return value if isinstance(value, str) else None
    return None


async def _server_live(plane: DataPlane, request: pb.ServerLiveRequest, metadata: Metadata) -> Message:
    return pb.ServerLiveResponse(live=True)


async def _server_ready(plane: DataPlane, request: pb.ServerReadyRequest, metadata: Metadata) -> Message:
    return pb.ServerReadyResponse(ready=await plane.not_ready() is None)


async def _model_ready(plane: DataPlane, request: pb.ModelReadyRequest, metadata: Metadata) -> Message:
    return pb.ModelReadyResponse(ready=(await plane.model_status(request.name, request.version or None)).ready)


async def _server_metadata(plane: DataPlane, request: pb.ServerMetadataRequest, metadata: Metadata) -> Message:
    return pb.ServerMetadataResponse(**v2.server_metadata(plane.server_name))


async def _model_metadata(plane: DataPlane, request: pb.ModelMetadataRequest, metadata: Metadata) -> Message:
    meta = await plane.metadata(request.name, request.version or None)
    return tensors.model_metadata({**v2.model_metadata(meta), "name": request.name})


async def _model_infer(plane: DataPlane, message: pb.ModelInferRequest, metadata: Metadata) -> Message:
    """Decoded into the same v2 request as HTTP's, batched and measured the same way."""
    version = message.model_version or None
    async with plane.admit(GRPC_INFER, message.model_name, route_key(metadata), version) as call:
        # Serve's gRPC proxy takes messages up to 2 GiB; the replica's own server refuses larger ones itself
        check_body_size(message.ByteSize(), plane.limits)
        body = tensors.to_request(message)
        result = await call.infer(v2.to_request(body))
        return tensors.to_response(result.model, body, result.logits)


async def _check(plane: DataPlane, request: health_pb2.HealthCheckRequest, metadata: Metadata) -> Message:
    """SERVING once every model is ready, NOT_SERVING while loading and once draining."""
    if request.service not in ("", INFERENCE):
        raise UnknownServiceError(f"unknown service {request.service!r}; ask '' or {INFERENCE}")
    ready = await plane.not_ready() is None
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    return health_pb2.HealthCheckResponse(status=status)


async def _watch(plane: DataPlane, request: health_pb2.HealthCheckRequest, metadata: Metadata) -> None:
    raise NotServedError("Watch is not served: poll Check")


RPCS = (
    Rpc(INFERENCE, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse, _server_live),
    Rpc(INFERENCE, "ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse, _server_ready),
    Rpc(INFERENCE, "ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse, _model_ready),
    Rpc(INFERENCE, "ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse, _server_metadata),
    Rpc(INFERENCE, "ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse, _model_metadata),
    Rpc(INFERENCE, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse, _model_infer),
    Rpc(HEALTH, "Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse, _check),
    Rpc(HEALTH, "Watch", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse, _watch, streaming=True),
)
