"""The entry points Serve's gRPC proxy calls on the ingress (on every node of a cluster, or with `--proxy`): a
method named after each RPC of service/rpc/rpcs.py, generated from that table. A service error's status and
message are set on Serve's context, which the proxy sends instead of an answer. No torch.
"""

from __future__ import annotations

from collections.abc import Callable

from ray.serve.grpc_util import RayServegRPCContext

from service.errors import ServiceError
from service.rpc.rpcs import RPCS, Rpc
from service.rpc.status import status_of


def _set_status(grpc_context: RayServegRPCContext, exc: ServiceError) -> None:
    grpc_context.set_code(status_of(exc))
    grpc_context.set_details(str(exc))


def _entry(rpc: Rpc) -> Callable:
    """The method Serve calls for `rpc`, on an object whose `plane` is the data plane; Serve passes its context by
    the keyword `grpc_context`."""

    async def unary(self, request, grpc_context: RayServegRPCContext):
        """An empty answer with the error's status for a service error (raising would log each refusal as a
        failure)."""
        try:
            return await rpc.answer(self.plane, request, grpc_context.invocation_metadata() or ())
        except ServiceError as exc:
            _set_status(grpc_context, exc)
            return rpc.response()

    async def stream(self, request, grpc_context: RayServegRPCContext):
        """A generator for Serve's proxy, which sends a stream's status only when the stream raises; the answer is
        closed however the stream ends (Serve cancels the call of a client gone)."""
        messages = rpc.answer(self.plane, request, grpc_context.invocation_metadata() or ())
        try:
            async for message in messages:
                yield message
        except ServiceError as exc:
            _set_status(grpc_context, exc)
            raise
        finally:
            await messages.aclose()

    entry = stream if rpc.streaming else unary
    entry.__name__ = entry.__qualname__ = rpc.name
    return entry


def add_entry_points(cls: type) -> type:
    """`cls` with a method named after each RPC, for Serve's gRPC proxy."""
    for rpc in RPCS:
        setattr(cls, rpc.name, _entry(rpc))
    return cls
