"""The ingress replica's own grpc.aio server (the local direct mode): every RPC of service/rpc/rpcs.py as a generic
method handler; a service error aborts the call with its status and message. No torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc

from service.config import RequestLimits
from service.dataplane import DataPlane
from service.errors import ServiceError
from service.rpc.rpcs import RPCS, Rpc
from service.rpc.status import status_of


def _behaviour(plane: DataPlane, rpc: Rpc):
    """The method's behaviour on a grpc.aio server: the RPC's answer, or an abort with the error's status."""

    async def unary(request, context: grpc.aio.ServicerContext):
        try:
            return await rpc.answer(plane, request, context.invocation_metadata() or ())
        except ServiceError as exc:
            await context.abort(status_of(exc), str(exc))

    async def stream(request, context: grpc.aio.ServicerContext):
        """Each message written as it comes. Written from a coroutine rather than yielded: gRPC cancels this task
        when the call is cancelled (or its deadline passes), and the `finally` then closes the answer at once."""
        messages = rpc.answer(plane, request, context.invocation_metadata() or ())
        try:
            async for message in messages:
                await context.write(message)
        except ServiceError as exc:
            await context.abort(status_of(exc), str(exc))
        finally:
            await messages.aclose()

    return stream if rpc.streaming else unary


def handlers(plane: DataPlane) -> list[grpc.GenericRpcHandler]:
    """One generic handler per service, with a method handler per RPC."""
    methods: dict[str, dict[str, grpc.RpcMethodHandler]] = defaultdict(dict)
    for rpc in RPCS:
        handler = grpc.unary_stream_rpc_method_handler if rpc.streaming else grpc.unary_unary_rpc_method_handler
        methods[rpc.service][rpc.name] = handler(
            _behaviour(plane, rpc),
            request_deserializer=rpc.request.FromString,
            response_serializer=rpc.response.SerializeToString,
        )
    return [grpc.method_handlers_generic_handler(service, by_name) for service, by_name in methods.items()]


class GrpcServer:
    """One grpc.aio server on the running event loop, bound at construction (a port that cannot be had fails the
    replica's start, saying why); messages over limits.max_body_bytes are refused by gRPC itself."""

    def __init__(self, plane: DataPlane, host: str, port: int, limits: RequestLimits, shared: bool = False) -> None:
        options = [
            ("grpc.max_receive_message_length", limits.max_body_bytes),
            # the HTTP server's bounds on connections, for this port's own: one more is closed at accept, and one
            # that has not begun HTTP/2 (its preface and settings) within header_timeout_s is closed
            ("grpc.max_allowed_incoming_connections", limits.max_connections),
            ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000)),
            # shared by the node's serving processes, or else a second server on the port must fail
            ("grpc.so_reuseport", int(shared)),
        ]
        self._server = grpc.aio.server(handlers=handlers(plane), options=options)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"the ingress cannot listen for gRPC on {address}: {exc}") from exc
        self._task = asyncio.get_running_loop().create_task(self._server.start())

    async def close(self, until: float) -> None:
        """Stop serving, losing no call sent: the port closes and clients get GOAWAY (gRPC's graceful stop; a call
        the server never took is one they may retry), calls in progress finish; returns once they have, or at
        `until` (a time.time())."""
        await self._task
        await self._server.stop(grace=max(0.0, until - time.time()))

    def check(self) -> None:
        """Raise if the server failed to start (Serve's health check then replaces the replica)."""
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise RuntimeError(f"the ingress's gRPC server stopped: {self._task.exception()!r}")
