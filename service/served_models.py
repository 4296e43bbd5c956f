"""The models one serving process answers for: each model's placement, its status once ready (metadata never
changes) and metric labels, and the routes table, swapped whole on a reconfigure. Readiness and metadata for every
transport are answered here. No torch, no transport.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from contract.metadata import ModelMetadata
from service.errors import ModelNotFoundError, NotReadyError
from service.inference import MODEL_VERSION, Listing, ModelStatus
from service.metrics import UNKNOWN_MODEL, IngressMetrics, model_labels
from service.placement import ModelPlacement
from service.routes import RouteConfigError, RouteTable

logger = logging.getLogger(__name__)


def shortened(name: str, limit: int = 80) -> str:
    """A name echoed in an error, cut to `limit` characters (a client can send any length)."""
    return name if len(name) <= limit else name[:limit] + "..."


def _dumped(route: Any) -> dict[str, Any]:
    return route.model_dump() if hasattr(route, "model_dump") else dict(route)


def ready(name: str, status: ModelStatus) -> ModelStatus:
    """The status of a ready model; NotReadyError saying why otherwise."""
    if not status.ready:
        raise NotReadyError(f"model {name!r} is not ready: {status.reason}")
    return status


class ServedModels:
    def __init__(
        self,
        placements: Mapping[str, ModelPlacement],
        routes: Mapping[str, Any],
        metrics: IngressMetrics,
        on_loaded: Callable[[], None],
    ) -> None:
        self._models = dict(sorted(placements.items()))
        self.names = list(self._models)
        self._metrics = metrics
        self._on_loaded = on_loaded  # a model's first ready status: its info gauge is set, to be refreshed from then
        self._ready: dict[str, ModelStatus] = {}  # name -> status of a loaded model
        self._labels: dict[str, dict[str, str]] = {}  # name -> its metric labels, once loaded
        self.routes = RouteTable.build(routes, self.names)
        self.routes_config = {name: _dumped(route) for name, route in routes.items()}  # as a user_config holds them
        self._routes_installed = False  # set by the first `install_routes`: a later invalid one keeps these

    def add(self, name: str, placement: ModelPlacement) -> ModelPlacement | None:
        """Serve `placement` as `name` from now on (a model loaded, or loaded again); the one it replaces, if any."""
        replaced = self._models.get(name)
        self._models = dict(sorted({**self._models, name: placement}.items()))
        self.names = list(self._models)
        self._forget(name)
        return replaced

    def remove(self, name: str) -> ModelPlacement | None:
        """Stop serving `name` (its requests in progress finish); the placement removed, or None when a route
        targets it or it is not served (a route is changed first)."""
        targeted = self.routes_targeting(name)
        if targeted:
            logger.error("model %r not unloaded: routes %s target it", name, targeted)
            return None
        placement = self._models.pop(name, None)
        self.names = list(self._models)
        self._forget(name)
        return placement

    def routes_targeting(self, name: str) -> list[str]:
        """The routes that send to `name` or mirror to it."""
        return [plan.name for plan in self.routes.plans.values() if name in (*plan.targets, plan.shadow)]

    def _forget(self, name: str) -> None:
        if self._ready.pop(name, None) is not None:
            self._metrics.model_gone(self._labels.pop(name))

    def install_routes(self, routes: Mapping[str, Any]) -> bool:
        """Swap in a new routes table (requests in progress keep their target). Invalid routes raise on the first
        install (a starting replica fails, saying why); later, they are logged and the served table kept (False)."""
        try:
            table = RouteTable.build(routes, self.names)
        except RouteConfigError as exc:
            if not self._routes_installed:
                raise
            logger.error("routes not changed: invalid config: %s", exc)
            return False
        self.routes, self._routes_installed = table, True
        self.routes_config = {name: _dumped(route) for name, route in routes.items()}
        return True

    @property
    def served_names(self) -> list[str]:
        """What a request may name: every model, then every route."""
        return [*self.names, *self.routes.names]

    def placement(self, name: str) -> ModelPlacement:
        model = self._models.get(name)
        if model is None:
            routes = f"; routes: {self.routes.names}" if self.routes.names else ""
            raise ModelNotFoundError(f"unknown model {shortened(name)!r}; models: {self.names}{routes}")
        return model

    def placements(self) -> list[ModelPlacement]:
        return list(self._models.values())

    def __contains__(self, name: str) -> bool:
        return name in self._models

    async def status(self, name: str, live: bool = False) -> ModelStatus:
        """The model's status: asked (of its replica, for a deployment) when `live` or until it was ready once."""
        cached = self._ready.get(name)
        if cached is not None and not live:
            return cached
        status = await self.placement(name).status()
        if status.ready and name not in self._ready:
            self._ready[name] = status
            self._labels[name] = model_labels(status.metadata, status.backend, name)
            self._metrics.model_info(status.metadata, status.backend)
            self._on_loaded()
        return status

    def labels(self, name: str, status: ModelStatus | None = None) -> dict[str, str]:
        """A model's metric labels: its head configuration once known, else its name (UNKNOWN_MODEL if not served)."""
        known = self._labels.get(name)
        if known is not None:
            return known
        if status is None:
            return model_labels(None, "", name if name in self._models else UNKNOWN_MODEL)
        return model_labels(status.metadata, status.backend, name)

    @staticmethod
    def check_version(name: str, version: str | None) -> None:
        if version is not None and version != MODEL_VERSION:
            raise ModelNotFoundError(
                f"model {shortened(name)!r} has no version {version!r}; versions: [{MODEL_VERSION!r}]"
            )

    async def not_ready(self) -> str | None:
        """Why not every model is ready, or None when they are."""
        statuses = await asyncio.gather(*(self.status(n, live=True) for n in self._models))
        waiting = {s.name: s.reason for s in statuses if not s.ready}
        return f"models not ready: {waiting}" if waiting else None

    async def model_status(self, name: str, version: str | None = None) -> ModelStatus:
        """A model's status, asked afresh (a route's: ready when each target is); ModelNotFoundError for an unknown
        model or version."""
        self.check_version(name, version)
        route = self.routes.get(name)
        if route is None:
            return await self.status(name, live=True)
        targets = await asyncio.gather(*(self.status(t, live=True) for t in route.targets))
        waiting = {s.name: s.reason for s in targets if not s.ready}
        return ModelStatus(name, not waiting, f"targets not ready: {waiting}" if waiting else "")

    async def metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        """A ready model's metadata; a route's heaviest target's (targets take the same inputs: they serve one
        task). The transport answers it under the name asked for."""
        self.check_version(name, version)
        route = self.routes.get(name)
        target = route.heaviest if route is not None else name
        return ready(target, await self.status(target)).metadata

    async def listing(self) -> Listing:
        statuses = list(await asyncio.gather(*(self.status(n, live=True) for n in self._models)))
        up = {s.name for s in statuses if s.ready}
        routes = [(r, all(t in up for t in r.targets)) for r in self.routes.plans.values()]
        return Listing(statuses, routes)
