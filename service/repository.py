"""The model repository of a running service: which models of `models_dir` are loaded, and loading (or loading
again) and unloading one in every serving process without a restart: the Open Inference Protocol's model repository
extension, as Triton's explicit model control serves it (its clients' load_model, unload_model and
get_model_repository_index work as they are). An administrative API: off unless the config enables it, and then
refused without its token.

One process takes the request; the change reaches every process as the ingress's user_config (`models`: name ->
generation), applied in place by each one's reconfigure (`load_wanted`, then `unload_unwanted` once the routes are
installed), as route reloads are. Models placed in their own
deployments are not loaded here: they come and go with a redeploy. No torch, no transport.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service import serve_control
from service.config import AppConfig
from service.errors import (
    BadRequestError,
    ConflictError,
    ModelFileError,
    ModelNotFoundError,
    RepositoryError,
    UnauthorizedError,
)
from service.model_store import find_models
from service.placement import ModelPlacement
from service.route_config import Route
from service.routes import RouteConfigError, RouteTable
from service.served_models import ServedModels, shortened

logger = logging.getLogger(__name__)
READY, UNAVAILABLE = "READY", "UNAVAILABLE"  # Triton's states in a repository index
APPLY_TIMEOUT_S = 120.0  # every process opens the model (ORT session, warm-up) before the change is answered
POLL_S = 0.05


@dataclass(frozen=True)
class IndexEntry:
    name: str
    state: str  # READY or UNAVAILABLE
    reason: str = ""


class Repository:
    """This process's share of the repository: the models it loaded (name -> generation; 0: loaded at start), the
    changes it asks of every process, and the steps that make this process serve what the user_config says."""

    def __init__(
        self,
        config: AppConfig,
        models: ServedModels,
        open_model: Callable[[str], ModelPlacement],
        app_name: str | None,
    ) -> None:
        self._config = config
        self._settings = config.repository
        self._models = models
        self._open = open_model
        self._app = app_name
        self._generations = {p.name: 0 for p in models.placements() if p.placement == "colocated"}
        self._failed: dict[str, str] = {}  # name -> why it could not be opened here
        self._closing: set[asyncio.Task] = set()
        self._changing = asyncio.Lock()  # one change at a time from this process
        self._applied: dict[str, Any] = {}  # the ingress's user_config this process applied last

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    @property
    def header(self) -> str:
        return self._settings.header

    def authorize(self, token: str | None) -> None:
        """UnauthorizedError unless `token` is the configured one (compared in constant time, as digests)."""
        given = hashlib.sha256((token or "").encode()).hexdigest()
        expected = (self._settings.token_sha256 or "").lower()
        if token is None or not hmac.compare_digest(given, expected):
            raise UnauthorizedError(f"the model repository API needs its token in the {self.header!r} header")

    # ---- the API ----
    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model folder, and every model served, with its state here."""
        entries = []
        for name in sorted({*self._folders(), *self._models.names}):
            if name in self._models:
                status = await self._models.status(name, live=True)
                entry = IndexEntry(name, READY if status.ready else UNAVAILABLE, status.reason)
            else:
                entry = IndexEntry(name, UNAVAILABLE, self._failed.get(name, "unloaded"))
            if entry.state == READY or not ready_only:
                entries.append(entry)
        return entries

    async def load(self, name: str) -> None:
        """Load `name` from its folder in every serving process (again, if loaded: its files may have changed);
        answered once every process serves it. RepositoryError (and nothing loaded) if it cannot be opened."""
        self._check_folder(name)
        if name in self._models and name not in self._generations:
            raise ConflictError(
                f"model {name!r} is placed in its own deployment: it is loaded with the application (redeploy it)"
            )
        if self._config.placement_for(name, _cluster_gpus()) == "deployment":
            raise ConflictError(
                f"model {name!r} would be placed in its own deployment (its placement setting): add it to the "
                "config and redeploy"
            )
        async with self._changing:
            wanted = {**await self._deployed_models(), name: time.time_ns()}
            await self._everywhere({"models": wanted})
            status = await self._models.status(name, live=True) if name in self._models else None
            if status is None or not status.ready:
                why = status.reason if status is not None else self._failed.get(name, "not opened")
                await self._everywhere({"models": {k: v for k, v in wanted.items() if k != name}})
                raise RepositoryError(f"model {name!r} failed to load: {why}")
        logger.info("repository: model %r loaded in every serving process", name)

    async def unload(self, name: str) -> None:
        """Stop serving `name` in every serving process; its requests in progress finish. Unloading a model that is
        not loaded does nothing."""
        if name not in self._models:
            self._check_folder(name)
            return
        if name not in self._generations:
            raise ConflictError(f"model {name!r} is placed in its own deployment: it goes with a redeploy")
        targeted = self._models.routes_targeting(name)
        if targeted:
            raise ConflictError(f"model {name!r} is a target of routes {targeted}: change the routes first")
        async with self._changing:
            wanted = {k: v for k, v in (await self._deployed_models()).items() if k != name}
            await self._everywhere({"models": wanted})
        logger.info("repository: model %r unloaded in every serving process", name)

    async def set_route(self, name: str, route: Route | None) -> None:
        """Set (or, None, remove) one route in every serving process, its other routes as deployed; answered once
        every process has it. BadRequestError for a route its models cannot serve, 404 removing an unknown one."""
        async with self._changing:
            deployed = await asyncio.to_thread(serve_control.deployed_ingress_config, self._app)
            routes = dict(deployed.get("routes", self._models.routes_config))
            if route is not None:
                routes[name] = route.model_dump()
            elif routes.pop(name, None) is None:
                raise ModelNotFoundError(f"no route {shortened(name)!r}; routes: {sorted(routes)}")
            try:
                RouteTable.build(routes, self._models.names)
            except RouteConfigError as exc:
                raise BadRequestError(str(exc)) from None
            await self._everywhere({"routes": routes})
        logger.info("repository: route %r %s in every serving process", name, "set" if route else "removed")

    def _folders(self) -> list[str]:
        """The model folders in models_dir now; none when it has none left (what is served is still listed)."""
        try:
            return find_models(self._config.models_dir)
        except ModelFileError:
            return []

    def _check_folder(self, name: str) -> None:
        folders = self._folders()
        if name not in folders:
            raise ModelNotFoundError(f"no model {shortened(name)!r} in the repository; folders: {folders}")

    async def _deployed_models(self) -> dict[str, int]:
        """The models every process is to serve now: the user_config's, or before any change what each loaded at
        start (they all load the same)."""
        deployed = await asyncio.to_thread(serve_control.deployed_ingress_config, self._app)
        return dict(deployed.get("models") or self._generations)

    async def _everywhere(self, changes: dict[str, Any]) -> None:
        """Have every serving process apply `changes` to the ingress's user_config, and wait until they have (this
        one's reconfigure ran, then Serve marks the application running again once every process has)."""
        await asyncio.to_thread(serve_control.update_ingress, self._app, changes)
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        while any(self._applied.get(key) != value for key, value in changes.items()):  # polled: Serve may run
            if time.monotonic() > deadline:  # reconfigure on another event loop
                raise RepositoryError(f"the change was not applied within {APPLY_TIMEOUT_S:g} s")
            await asyncio.sleep(POLL_S)
        if not await asyncio.to_thread(serve_control.wait_running, self._app, 0.05, deadline):
            raise RepositoryError(f"not every serving process applied the change within {APPLY_TIMEOUT_S:g} s")

    # ---- every process: the user_config's `models` applied ----
    async def load_wanted(self, wanted: dict[str, int]) -> None:
        """Serve the co-located models `wanted` (name -> generation), first step: open the new ones (and those of a
        new generation) off the event loop; one replaced is closed once idle. A model that cannot be opened is
        logged and left out. `unload_unwanted` is the second step, once the routes are installed."""
        for name, generation in wanted.items():
            if self._generations.get(name) == generation and name in self._models:
                continue
            try:
                placement = await asyncio.to_thread(self._open, name)
            except Exception as exc:  # a backend that cannot be honoured here, say: this model only
                self._failed[name] = f"{type(exc).__name__}: {exc}"
                logger.error("repository: model %r not loaded: %s", name, self._failed[name])
                continue
            self._failed.pop(name, None)
            if (old := self._models.add(name, placement)) is not None:
                self._retire(old)
            self._generations[name] = generation

    def unload_unwanted(self, wanted: dict[str, int]) -> None:
        """Stop serving the co-located models not in `wanted` (a model a route still targets stays; each removed is
        closed once idle)."""
        for name in [n for n in self._generations if n not in wanted]:
            if (old := self._models.remove(name)) is not None:
                self._retire(old)
                del self._generations[name]

    def applied(self, user_config: dict[str, Any]) -> None:
        """The end of this process's reconfigure: a change waiting on it is answered."""
        self._applied = dict(user_config)

    def _retire(self, placement: ModelPlacement) -> None:
        task = asyncio.get_running_loop().create_task(close_when_idle(placement, self._config.limits.drain_s))
        self._closing.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._closing.discard)


async def close_when_idle(placement: ModelPlacement, within_s: float) -> None:
    """Close a placement no longer served once its requests in progress are done (or after `within_s`)."""
    deadline = time.monotonic() + within_s
    while placement.busy() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    placement.close()


def _cluster_gpus() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
