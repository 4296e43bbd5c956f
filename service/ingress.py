"""The ingress deployment: a Serve replica that builds the data plane (service/dataplane.py) over its models'
placements (engines in this process, or handles of their own deployments) and starts the transports: the one ASGI
application (service/http/api.py) for Serve's proxy or on its own port, the gRPC services (service/rpc/) for Serve's
gRPC proxy or on their own port. No torch.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from service.coalescer import Coalescer
from service.config import AppConfig
from service.dataplane import DataPlane
from service.decoder_placement import ColocatedDecoder
from service.engine import EngineSettings, ModelEngine
from service.http.api import InferenceFirst, create_app
from service.http.server import HttpServer
from service.model_store import is_decoder
from service.placement import Colocated, ModelPlacement, Remote
from service.remote_decoder import RemoteDecoder
from service.repository import Repository
from service.rpc.serve_proxy import add_entry_points
from service.rpc.server import GrpcServer
from service.stop_notice import listen
from service.thread_names import LOOP, name_thread

# Of a stop's period, what is kept for the open connections' last answers once the ports close.
CLOSE_RESERVE_S = 1.0
SERVED_BY = (
    "x-served-by"  # the serving process (its Serve replica id, as the metrics' `replica` label ends) that answered
)


def placements(
    config: AppConfig, remote: dict[str, DeploymentHandle], colocated: list[str]
) -> dict[str, ModelPlacement]:
    """Each model's placement: its engine in this process, or its deployment's handle (requests that wait here
    going as one Ray call per group when `ingress.coalesce` is on)."""
    models: dict[str, ModelPlacement] = {name: open_colocated(config, name) for name in colocated}
    for name, handle in remote.items():
        if is_decoder(config.models_dir, name):
            models[name] = RemoteDecoder(name, handle)
            continue
        coalescer = None
        if config.ingress.coalesce:
            settings = config.settings_for(name)
            coalescer = Coalescer(name, handle, settings.max_batch_size, settings.max_queued_requests)
        models[name] = Remote(name, handle, coalescer)
    return models


def open_colocated(config: AppConfig, name: str) -> Colocated | ColocatedDecoder:
    """A model's engine in this process (its ORT sessions opened and warmed up: blocks); a decoder's generation
    engine (config.generate) for a decoder."""
    if is_decoder(config.models_dir, name):
        settings = config.generate.settings(config.backend_for(name))
        return ColocatedDecoder.open(config.models_dir, name, settings)
    processes = config.ingress.process_count() if config.ingress.on_own_ports else 1
    settings = EngineSettings.of(config.settings_for(name), config.backend_for(name), "colocated", processes)
    return Colocated(ModelEngine(config.models_dir, name, settings))


@serve.deployment
@serve.ingress()
@add_entry_points  # a method per RPC, which Serve's gRPC proxy calls by name
class Ingress:
    """One serving process: the data plane and its transports. With `ingress.port` (and `grpc_port`), serves them
    on those ports itself; Serve's proxies reach the same application and services either way."""

    def __init__(self, remote: dict[str, DeploymentHandle], colocated: list[str], config: AppConfig) -> None:
        self.plane = DataPlane(config, placements(config, remote, colocated))
        context = serve.get_replica_context()
        opener = functools.partial(open_colocated, config)
        self.repository = Repository(config, self.plane.models, opener, context.app_name)
        self._app = create_app(self.plane, self.repository)
        ingress, limits = config.ingress, config.limits
        self._server = self._grpc = None
        shared = ingress.on_own_ports and ingress.process_count() > 1
        if ingress.port is not None:  # bound once the co-located models are loaded: no connection meets a loading one
            served_by = [(SERVED_BY, context.replica_tag)]
            self._server = HttpServer(
                InferenceFirst(self._app, self.plane),
                ingress.host,
                ingress.port,
                limits,
                ingress.access_log,
                load=self.plane.load,
                shared=shared,
                headers=served_by,
            )
            self.plane.on_refresh(self._server.connection_metrics.refresh)
        if ingress.grpc_port is not None:
            self._grpc = GrpcServer(self.plane, ingress.host, ingress.grpc_port, limits, shared)
        self._stop: asyncio.Task | None = None
        self._notices: asyncio.Task | None = None
        name_thread(LOOP)  # the constructor runs on the thread of the loop that will serve (thread_names.py)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place reconfigure (the deployment's user_config changed, no restart): load and unload models
        (service/repository.py) and install the routes whole.
        Invalid routes fail a starting replica, saying why; a running one logs why and keeps serving the routes it
        has (Serve would otherwise replace every replica with one that cannot start). `stop_notice`: the launcher's
        socket for the stop (service/stop_notice.py). `stopping_until`: this process stops (`stop`); `drain_until`:
        the same, and the reconfigure ends once the stop has."""
        if (path := user_config.get("stop_notice")) is not None and self._notices is None:
            self._notices = asyncio.get_running_loop().create_task(listen(path, self.stop))
        models = user_config.get("models")  # the model repository's: loaded first, unloaded once routes changed
        if models is not None:
            await self.repository.load_wanted(models)
        routes_changed = self.plane.models.install_routes(user_config.get("routes") or {})
        if models is not None:
            self.repository.unload_unwanted(models)
        if routes_changed or models is not None:
            self._app.openapi_schema = None  # the document names the models and routes: built again when asked
        self.repository.applied(user_config)
        if (until := user_config.get("stopping_until")) is not None:
            self.stop(until)
        if (until := user_config.get("drain_until")) is not None:
            await self.stop(until)

    def stop(self, until: float) -> asyncio.Future:
        """This process stops by `until` (a time.time()), once, whoever asks first: readiness answers 503 at once;
        requests keep being served, on new connections too (a load balancer may not have seen the 503 yet), until
        none is in progress (or CLOSE_RESERVE_S before `until`); then the ports close and each open connection is
        closed after its last answer. Done (the inference requests left) once every connection is closed."""
        if self._stop is None:
            self._stop = asyncio.get_running_loop().create_task(self._stopped(until))
        return asyncio.shield(self._stop)

    async def _stopped(self, until: float) -> int:
        await self.plane.drained(until - CLOSE_RESERVE_S)
        servers = [server for server in (self._server, self._grpc) if server is not None]
        await asyncio.gather(*(server.close(until) for server in servers))
        return self.plane.load.inference

    def __serve_build_asgi_app__(self):
        """Serve's hook for an application built by the replica: the one application, for Serve's proxy."""
        return self._app

    def check_health(self) -> None:
        """Serve's health check: the replica's own HTTP and gRPC servers must still be serving."""
        for server in (self._server, self._grpc):
            if server is not None:
                server.check()

    def drain(self) -> int:
        """This replica's readiness answers 503 from now on; returns its inference requests in progress. (The
        launcher drains every replica through `reconfigure`.)"""
        return self.plane.drain()
