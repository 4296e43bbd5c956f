"""The ingress replica's own grpc.aio server (the local direct mode): every RPC of service/rpc/rpcs.py as a generic
method handler; a service error aborts the call with its status and message, and so do bytes that are not the RPC's
message and a stream's client that takes none of it for send_timeout_s. No torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator

import grpc
from google.protobuf.message import DecodeError, Message

from service.config import RequestLimits
from service.dataplane import DataPlane
from service.errors import BadRequestError, ServiceError
from service.rpc.rpcs import RPCS, Rpc
from service.rpc.status import status_of

logger = logging.getLogger(__name__)


class Stalled(Exception):
    """A stream's client took none of it for send_timeout_s."""


def _decoded(rpc: Rpc, raw: bytes) -> Message:
    """The call's message from its bytes: decoded here, not by gRPC, which answers a deserializer's error with
    UNKNOWN and a Python traceback's words; bytes that are not the message are a 400 (INVALID_ARGUMENT)."""
    try:
        return rpc.request.FromString(raw)
    except DecodeError as exc:
        raise BadRequestError(f"malformed request message: {exc}") from None  # the error names the message type


async def _write_each(messages: AsyncGenerator[Message, None], context, send_timeout_s: float) -> None:
    """Each message written as it comes, each write within `send_timeout_s` (gRPC's waits while the client's
    flow-control window is full), else Stalled; the messages are closed however it ends (the sequence leaves), before
    any status is sent."""
    try:
        async for message in messages:
            try:
                async with asyncio.timeout(send_timeout_s):
                    await context.write(message)
            except TimeoutError:
                raise Stalled(f"the client took none of the stream for {send_timeout_s:g} s: ended") from None
    finally:
        await messages.aclose()


def _behaviour(plane: DataPlane, rpc: Rpc):
    """The method's behaviour on a grpc.aio server: the RPC's answer, or an abort with the error's status."""

    async def unary(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return await rpc.answer(plane, _decoded(rpc, raw), context.invocation_metadata() or ())
        except ServiceError as exc:
            await context.abort(status_of(exc), str(exc))

    async def stream(raw: bytes, context: grpc.aio.ServicerContext):
        """Written from a coroutine rather than yielded: gRPC cancels this task when the call is cancelled (or its
        deadline passes), and the answer is then closed at once."""
        try:
            messages = rpc.answer(plane, _decoded(rpc, raw), context.invocation_metadata() or ())
            await _write_each(messages, context, plane.limits.send_timeout_s)
        except ServiceError as exc:
            await context.abort(status_of(exc), str(exc))
        except Stalled as exc:
            # The status goes after what the client has not read: the call ends once it reads or leaves, or once it
            # answers no ping (the server's keepalive); its sequence has left already.
            logger.info("%s", exc)
            try:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            except grpc.aio.InternalError:  # the connection closed first: gone, as a call its client cancelled
                raise asyncio.CancelledError from None

    return stream if rpc.streaming else unary


def handlers(plane: DataPlane) -> list[grpc.GenericRpcHandler]:
    """One generic handler per service, with a method handler per RPC."""
    methods: dict[str, dict[str, grpc.RpcMethodHandler]] = defaultdict(dict)
    for rpc in RPCS:
        handler = grpc.unary_stream_rpc_method_handler if rpc.streaming else grpc.unary_unary_rpc_method_handler
        methods[rpc.service][rpc.name] = handler(
            _behaviour(plane, rpc),
            request_deserializer=None,  # the raw bytes: decoded by the behaviour (_decoded)
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
            # a peer that answers no HTTP/2 ping within send_timeout_s is gone, as a stream's client that takes none
            # of it for that long: its connection is closed, and the calls it held (pinged only while it has calls)
            ("grpc.keepalive_time_ms", int(limits.send_timeout_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(limits.send_timeout_s * 1000)),
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
