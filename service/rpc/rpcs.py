"""Every RPC the service answers, each declared once: the Open Inference Protocol's GRPCInferenceService, the
project's GenerationService (token generation, streamed) and grpc.health.v1's Health, answered from the data plane
whichever way a call comes in (the replica's own gRPC server, service/rpc/server.py, or Serve's gRPC proxy,
service/rpc/serve_proxy.py). No torch.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from contract.rpc import generation_pb2 as generation_pb
from contract.rpc import inference_pb2 as pb
from service.dataplane import DataPlane, Endpoint
from service.errors import NotServedError, UnknownServiceError
from service.limits import check_body_size
from service.protocol import v2
from service.routes import ROUTE_KEY
from service.rpc import generation, tensors

INFERENCE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
GENERATION = generation_pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
GRPC_INFER = Endpoint("grpc_infer")  # not counted from arrival: calls waiting inside gRPC are not seen
GRPC_GENERATE = Endpoint("grpc_generate")
Metadata = Sequence[tuple[str, Any]]  # a call's invocation metadata: (key, value) pairs
Unary = Callable[[DataPlane, Any, Metadata], Awaitable[Message]]
# a stream's messages; the transport closes the generator however the call ends (a client gone included)
Streamed = Callable[[DataPlane, Any, Metadata], AsyncGenerator[Message, None]]


@dataclass(frozen=True)
class Rpc:
    service: str  # the full service name
    name: str  # the method name, as gRPC and Serve's proxy call it
    request: type[Message]
    response: type[Message]
    answer: Unary | Streamed  # raises a ServiceError where there is no answer (a stream: before or between messages)
    streaming: bool = False  # unary-stream: `answer` is Streamed


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


async def _model_generate(
    plane: DataPlane, message: generation_pb.ModelGenerateRequest, metadata: Metadata
) -> AsyncGenerator[Message, None]:
    """Decoded into the same generate request as HTTP's; each token event of the data plane's one entry is a
    message. Closing this generator (the call cancelled, its deadline past) ends the sequence within a step."""
    arrived = time.perf_counter()  # the handler's start: gRPC tells no time of arrival
    check_body_size(message.ByteSize(), plane.limits)  # as ModelInfer: Serve's proxy takes up to 2 GiB
    body = generation.to_body(message)
    events = plane.generate(GRPC_GENERATE, message.model_name, lambda _: generation.to_request(message, body, arrived))
    try:
        async for _, event in events:  # one choice
            yield generation.to_response(message.model_name, body, event)
    finally:
        await events.aclose()


async def _check(plane: DataPlane, request: health_pb2.HealthCheckRequest, metadata: Metadata) -> Message:
    """SERVING once every model is ready, NOT_SERVING while loading and once draining."""
    if request.service not in ("", INFERENCE, GENERATION):
        raise UnknownServiceError(f"unknown service {request.service!r}; ask '', {INFERENCE} or {GENERATION}")
    ready = await plane.not_ready() is None
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    return health_pb2.HealthCheckResponse(status=status)


async def _watch(
    plane: DataPlane, request: health_pb2.HealthCheckRequest, metadata: Metadata
) -> AsyncGenerator[Message, None]:
    raise NotServedError("Watch is not served: poll Check")
    yield  # a stream that refuses before its first message


RPCS = (
    Rpc(INFERENCE, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse, _server_live),
    Rpc(INFERENCE, "ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse, _server_ready),
    Rpc(INFERENCE, "ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse, _model_ready),
    Rpc(INFERENCE, "ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse, _server_metadata),
    Rpc(INFERENCE, "ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse, _model_metadata),
    Rpc(INFERENCE, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse, _model_infer),
    Rpc(
        GENERATION,
        "ModelGenerate",
        generation_pb.ModelGenerateRequest,
        generation_pb.ModelGenerateResponse,
        _model_generate,
        streaming=True,
    ),
    Rpc(HEALTH, "Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse, _check),
    Rpc(HEALTH, "Watch", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse, _watch, streaming=True),
)
