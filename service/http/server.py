"""The ingress replica's own HTTP server: a stock uvicorn server (public `uvicorn.Config` options, the protocol and
signal handling from service/http/uvicorn_adapter.py) on the replica's event loop, serving the service's ASGI
application on `ingress.port`, so that no proxy and no per-request Serve wrapper stand between a client and the
application. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn

from service.config import RequestLimits
from service.http import uvicorn_adapter
from service.http.connection_metrics import ConnectionMetrics
from service.load import Load

KEEP_ALIVE_S = 30  # idle keep-alive connections are closed after this (uvicorn's default 5 s cut load generators off)


def _listening_socket(host: str, port: int, shared: bool) -> socket.socket:
    """A socket bound to host:port, reusing the address: after a crash, the old connections' TIME_WAIT must not keep
    a restarted replica off its port. `shared`: the node's other serving processes bind it too (SO_REUSEPORT, the
    kernel spreads connections among them); else a second server on the port fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"the ingress cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class AccessLog:
    """ASGI middleware: one line per request (uvicorn's format) through Serve's logger, which writes it to the
    replica's log file and, where Serve logs to stderr, to the server's output."""

    def __init__(self, app) -> None:
        self.app = app
        self.logger = logging.getLogger("ray.serve")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def noting(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else "-"
            request = f"{scope['method']} {scope['path']} HTTP/{scope['http_version']}"
            self.logger.info('%s - "%s" %s', client, request, status[0] if status else "-")


class HttpServer:
    """One uvicorn server over `app`, started on the running event loop; bound at construction, so a port that
    cannot be had fails the replica's start, saying why. Its requests in progress are counted in `load` (from their
    head), its connections in `connection_metrics`; `headers` go with every response."""

    def __init__(
        self,
        app,
        host: str,
        port: int,
        limits: RequestLimits,
        access_log: bool = False,
        keep_alive_s: int = KEEP_ALIVE_S,
        load: Load | None = None,
        shared: bool = False,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.connection_metrics = ConnectionMetrics()
        self.load = load if load is not None else Load()
        self.load.counting = True
        config = uvicorn.Config(
            AccessLog(app) if access_log else app,
            http=uvicorn_adapter.protocol(limits, self.connection_metrics, self.load),
            lifespan="off",
            log_config=None,
            access_log=False,  # uvicorn's own access logger is reconfigured by Serve in a replica: AccessLog instead
            timeout_keep_alive=keep_alive_s,
            server_header=False,
            headers=headers or [],  # added to every response by uvicorn itself
            proxy_headers=False,  # it faces clients itself: no X-Forwarded-* rewriting of every request's scope
            timeout_graceful_shutdown=limits.drain_s,  # a stop's wait for open connections' last answers
        )
        self._server = uvicorn_adapter.SignalFreeServer(config)
        self._socket = _listening_socket(host, port, shared)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        self._closing = False

    async def close(self, until: float) -> None:
        """Stop serving, losing no request sent: the listener closes (uvicorn's graceful shutdown), and each open
        connection closes after its last answer (service/http/uvicorn_adapter.py); returns once every connection is
        closed, or at `until` (a time.time())."""
        self._closing = True
        self._server.should_exit = True  # uvicorn's main loop sees it within 0.1 s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), max(0.0, until - time.time()))

    def requests_in_progress(self) -> int:
        """Requests whose head was read and whose response is not complete yet, every connection's."""
        return self.load.arrived

    def open_connections(self) -> int:
        """Connections open now, refused ones still closing included."""
        return self.connection_metrics.open

    def check(self) -> None:
        """Raise if the server stopped unasked (Serve's health check then replaces the replica)."""
        if self._task.done() and not self._closing:
            error = None if self._task.cancelled() else self._task.exception()
            raise RuntimeError(f"the ingress's HTTP server stopped: {error!r}")
