"""The ingress's own gRPC server (service/rpc/server.py) in process, with no models, on loopback: it holds the HTTP
server's bounds on connections for its own port, `limits.max_connections` (one more closed at accept, those under
it served) and `limits.header_timeout_s` (a connection that does not begin HTTP/2 in time closed). Both are gRPC
channel arguments: each test fails if gRPC stops honouring its argument."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.config import AppConfig
from service.dataplane import DataPlane
from service.local.ports import free_port
from service.rpc.server import GrpcServer

CAP = 8  # the least max_connections RequestLimits allows


def _started(**limits) -> tuple[GrpcServer, str]:
    """The server on a free port (keep the object: a server no longer referenced stops), and its address."""
    plane = DataPlane(AppConfig(models_dir="unused", models=[], limits=limits), {})
    port = free_port()
    return GrpcServer(plane, "127.0.0.1", port, plane.limits), f"127.0.0.1:{port}"


async def _check(address: str, wait_s: float = 0.0) -> grpc.aio.Channel | grpc.StatusCode:
    """A fresh connection's grpc.health.v1 Check: its channel, kept open, when answered; else the call's status.
    With `wait_s`, the call waits that long for a connection (gRPC's wait_for_ready)."""
    channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])  # its own
    try:
        request = health_pb2.HealthCheckRequest()
        await health_pb2_grpc.HealthStub(channel).Check(request, timeout=wait_s or 5, wait_for_ready=bool(wait_s))
        return channel
    except grpc.aio.AioRpcError as error:
        await channel.close()
        return error.code()


def test_connections_over_max_connections_are_closed_at_accept_and_those_under_it_are_served():
    async def scenario() -> tuple[int, grpc.StatusCode, bool]:
        server, address = _started(max_connections=CAP)
        await asyncio.sleep(0.2)
        held = [await _check(address) for _ in range(CAP)]
        one_more = await _check(address)
        open_channels = [c for c in held if isinstance(c, grpc.aio.Channel)]
        served = len(open_channels)
        await open_channels.pop().close()  # a slot freed: the next connection is served
        freed = await _check(address, wait_s=5)
        for channel in [*open_channels, freed]:
            if isinstance(channel, grpc.aio.Channel):
                await channel.close()
        del server
        return served, one_more, isinstance(freed, grpc.aio.Channel)

    served, one_more, freed = asyncio.run(scenario())
    assert served == CAP and one_more == grpc.StatusCode.UNAVAILABLE and freed, (served, one_more, freed)


def test_a_connection_that_does_not_begin_http2_within_header_timeout_s_is_closed():
    async def scenario() -> float:
        server, address = _started(header_timeout_s=1.0)
        await asyncio.sleep(0.2)
        host, port = address.rsplit(":", 1)
        opened = time.perf_counter()
        silent = socket.create_connection((host, int(port)), timeout=5)  # sends nothing, not even HTTP/2's preface

        def until_closed() -> None:
            while silent.recv(4096):  # the server's settings frame, then the close
                pass

        await asyncio.to_thread(until_closed)
        silent.close()
        del server
        return time.perf_counter() - opened

    seconds = asyncio.run(scenario())
    assert 1.0 <= seconds < 3.0, seconds
