"""Finding the service, its models and routes over HTTP: the loopback guard, `/v1/models` (or `/v2`), selection."""

from __future__ import annotations

import ipaddress
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx

from loadtest.stats import DEFAULT_PRECISION, precision_rank

_HEAD_KEYS = ("heads", "head_dim", "d_model", "layers", "max_len")


class DiscoveryError(RuntimeError):
    """The service cannot be reached, does not list models, or lacks a model that was asked for."""


class RemoteURLError(ValueError):
    """A non-loopback URL without --allow-remote."""


@dataclass(frozen=True)
class Route:
    """A route as the service lists it: target models by weight (in its order), an optional shadow, readiness."""

    name: str
    targets: tuple[tuple[str, float], ...]  # (model, weight): any numbers >= 0, not all 0
    shadow: str = ""  # the model it mirrors a fraction of its requests to; "" for none
    shadow_fraction: float = 0.0
    ready: bool = True

    def weights(self) -> dict[str, float]:
        return dict(self.targets)

    def to_json(self) -> dict[str, object]:
        shadow = {"model": self.shadow, "fraction": self.shadow_fraction} if self.shadow else None
        return {"targets": self.weights(), "shadow": shadow}


@dataclass(frozen=True)
class ModelInfo:
    """One served model as the service describes it: its head configuration, precision, backend and readiness.

    A route is one too (`route` set): each head configuration value is its targets' (`route_model`)."""

    name: str
    heads: int | str  # a route whose targets differ: theirs joined, e.g. "8|4"
    head_dim: int | str
    d_model: int | str
    layers: int | str
    max_len: int  # a route: the smallest of its targets' (texts must fit each)
    backend: str = ""
    ready: bool = True
    precision: str = DEFAULT_PRECISION
    quantized_from: str = ""  # an int8 or fp16 variant's fp32 source model, e.g. mha-h8-d512
    route: Route | None = None
    arch: str = "classifier"  # or "decoder": load-tested with streamed completions (a server from before: classifier)
    kv_heads: int = 0  # a decoder's key/value heads

    @property
    def is_decoder(self) -> bool:
        return self.arch == "decoder"

    @property
    def measurable(self) -> bool:
        """Whether its configuration is known (a model still loading, or a route none of whose targets is listed
        with one, is not)."""
        return self.max_len > 0 if self.route else isinstance(self.heads, int) and self.heads > 0

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out.pop("route")
        return out | ({"route": self.route.to_json()} if self.route else {})


@dataclass(frozen=True)
class Listing:
    """What `/v1/models` lists: the models, and the routes (none from a server from before routes)."""

    models: tuple[ModelInfo, ...]
    routes: tuple[Route, ...] = ()

    def by_name(self) -> dict[str, ModelInfo]:
        """Every model and route by name, a route as its `route_model`."""
        out = {route.name: route_model(route, self.models) for route in self.routes}
        return out | {m.name: m for m in self.models}  # a route named like a model: the service refuses one


def check_loopback(url: str, allow_remote: bool, flag: str = "--url") -> str:
    """The URL without a trailing slash; RemoteURLError unless it is http(s) on a loopback host (or allowed)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteURLError(f"{flag} {url!r} is not an http:// or https:// URL with a host")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost" or host.endswith(".localhost")
    if not loopback and not allow_remote:
        raise RemoteURLError(
            f"{flag} {url!r} is not a loopback address (127.0.0.1, ::1, localhost); "
            "pass --allow-remote to load-test another machine"
        )
    return url.rstrip("/")


def _get_json(client: httpx.Client, url: str) -> object:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise DiscoveryError(f"cannot reach the service at {url}: {exc.__class__.__name__}: {exc}") from None
    if response.status_code != 200:
        raise DiscoveryError(f"GET {url} answered {response.status_code}: {response.text[:200]}")
    try:
        return response.json()
    except ValueError:
        raise DiscoveryError(f"GET {url} did not answer JSON: {response.text[:200]!r}") from None


def _sources(entry: dict) -> list[dict]:
    """Where an entry's settings may be: top level, `config`, `metadata`, or v2 metadata's `parameters`."""
    nested = (entry.get(key) for key in ("config", "metadata", "parameters"))
    return [entry, *(source for source in nested if isinstance(source, dict))]


def _as_int(entry: dict, key: str, name: str) -> int:
    for source in _sources(entry):
        if isinstance(source.get(key), int):
            return source[key]
    raise DiscoveryError(f"model {name!r} in the service's listing has no integer {key!r}: {entry}")


def _as_str(entry: dict, key: str, default: str) -> str:
    for source in _sources(entry):
        if isinstance(source.get(key), str) and source[key]:
            return source[key]
    return default


def parse_model(entry: object) -> ModelInfo:
    """A ModelInfo from one `/v1/models` entry (head configuration at top level or under `config`); an entry
    without a precision (a server from before quantized variants) is fp32."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise DiscoveryError(f"a model in the service's listing has no name: {entry!r}")
    name = entry["name"]
    ready = entry.get("ready", entry.get("state", "ready"))
    ready = ready if isinstance(ready, bool) else str(ready).lower() in ("ready", "true", "running", "healthy")
    if not ready and not all(key in entry for key in _HEAD_KEYS):
        return ModelInfo(name, 0, 0, 0, 0, 0, ready=False)  # a model still loading: configuration not known yet
    values = {key: _as_int(entry, key, name) for key in _HEAD_KEYS}
    precision = _as_str(entry, "precision", DEFAULT_PRECISION)
    quantized_from = _as_str(entry, "quantized_from", "")
    backend = str(entry.get("backend", ""))
    arch = _as_str(entry, "arch", "classifier")
    kv_heads = _as_int(entry, "kv_heads", name) if arch == "decoder" else 0
    return ModelInfo(
        name,
        **values,
        backend=backend,
        ready=ready,
        precision=precision,
        quantized_from=quantized_from,
        arch=arch,
        kv_heads=kv_heads,
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_route(entry: object) -> Route:
    """A Route from one entry of `/v1/models`' `routes`; DiscoveryError names what is wrong with one."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise DiscoveryError(f"a route in the service's listing has no name: {entry!r}")
    name, targets, shadow = entry["name"], entry.get("targets"), entry.get("shadow")
    if not isinstance(targets, dict) or not targets:
        raise DiscoveryError(f"route {name!r} in the service's listing has no targets: {entry}")
    if not all(isinstance(t, str) and _number(w) and w >= 0 for t, w in targets.items()) or not any(targets.values()):
        raise DiscoveryError(
            f"route {name!r} in the service's listing: targets must map model names to weights >= 0, not all 0, "
            f"got {targets}"
        )
    pairs = tuple((t, float(w)) for t, w in targets.items())
    ready = entry.get("ready", True) is True
    if shadow is None:
        return Route(name, pairs, ready=ready)
    if not isinstance(shadow, dict) or not isinstance(shadow.get("model"), str) or not _number(shadow.get("fraction")):
        raise DiscoveryError(f"route {name!r} in the service's listing has a shadow without model and fraction")
    return Route(name, pairs, shadow["model"], float(shadow["fraction"]), ready)


def _joined(values: list[object]) -> int | str:
    """One value where the targets agree, else each target's, joined with "|" in the route's order ("8|4")."""
    if len(set(values)) == 1:
        return values[0]  # type: ignore[return-value]
    return "|".join(str(v) for v in values)


def route_model(route: Route, models: tuple[ModelInfo, ...] | list[ModelInfo]) -> ModelInfo:
    """A route as a ModelInfo: each head configuration value its targets' (`_joined`; "?" for a target not listed
    with a configuration) and the smallest max_len of them (0 when none is known)."""
    listed = {m.name: m for m in models if m.measurable}
    targets = [listed.get(name) for name, _ in route.targets]

    def joined(key: str) -> int | str:
        return _joined([getattr(m, key) if m else "?" for m in targets])

    max_len = min((m.max_len for m in targets if m), default=0)
    values = {key: joined(key) for key in ("heads", "head_dim", "d_model", "layers")}
    backend, precision = str(joined("backend")), str(joined("precision"))
    return ModelInfo(
        route.name, **values, max_len=max_len, backend=backend, ready=route.ready, precision=precision, route=route
    )


def _listing_entries(listing: object) -> list:
    if isinstance(listing, dict):
        listing = listing.get("models", listing.get("data"))
    if not isinstance(listing, list):
        raise DiscoveryError(f"the service's model listing is not a list of models: {str(listing)[:200]}")
    return listing


def parse_routes(listing: object) -> tuple[Route, ...]:
    """The routes of a `/v1/models` answer (none from a server from before routes)."""
    routes = listing.get("routes", []) if isinstance(listing, dict) else []
    if not isinstance(routes, list):
        raise DiscoveryError(f"the service's route listing is not a list of routes: {str(routes)[:200]}")
    return tuple(parse_route(r) for r in routes)


def discover(client: httpx.Client, base_url: str) -> Listing:
    """Every model (and route) the service serves, from `/v1/models`, else models from `/v2` plus
    `/v2/models/{name}`."""
    listing: object = None
    try:
        listing = _get_json(client, f"{base_url}/v1/models")
        entries = _listing_entries(listing)
    except DiscoveryError as first:
        if str(first).startswith("cannot reach"):
            raise
        server = _get_json(client, f"{base_url}/v2")
        names = server.get("models", []) if isinstance(server, dict) else []
        if not names:
            raise first from None
        entries = [_get_json(client, f"{base_url}/v2/models/{n}") for n in names]
    models = [parse_model(e) for e in entries]
    if not models:
        raise DiscoveryError(f"the service at {base_url} serves no models")
    return Listing(tuple(models), parse_routes(listing))


def check_extension(client: httpx.Client, base_url: str, extension: str, needed_by: str) -> None:
    """DiscoveryError unless the service's `GET /v2` lists `extension`."""
    server = _get_json(client, f"{base_url}/v2")
    listed = server.get("extensions") if isinstance(server, dict) else None
    if not isinstance(listed, list) or extension not in listed:
        raise DiscoveryError(
            f"the service at {base_url} does not list the {extension} extension that {needed_by} needs "
            f"(GET /v2 lists {listed})"
        )


def select_models(models: list[ModelInfo], spec: str, routes: tuple[Route, ...] = ()) -> list[ModelInfo]:
    """`all` models (by d_model, h, then precision: each int8 variant right after its fp32 source; routes only when
    named) or a comma-separated list of model and route names, in the order asked; DiscoveryError names unknown
    ones and lists what is served."""
    if spec.strip() == "all":
        return sorted(models, key=lambda m: (m.d_model, m.heads, precision_rank(m.precision), m.name))
    by_name = Listing(tuple(models), routes).by_name()
    wanted = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        asked = ", ".join(unknown) if unknown else repr(spec)
        served = ", ".join(sorted(m.name for m in models))
        listed_routes = f"; routes: {', '.join(sorted(r.name for r in routes))}" if routes else ""
        raise DiscoveryError(f"unknown model(s) {asked}; the service serves: {served}{listed_routes}")
    return [by_name[n] for n in wanted]


def _answers_ready(client: httpx.Client, base_url: str, model: ModelInfo) -> bool:
    """A model: `/v2/models/{name}/ready` answers 200; a route: the listing says it is ready."""
    try:
        if model.route is None:
            return client.get(f"{base_url}/v2/models/{model.name}/ready").status_code == 200
        return any(r.name == model.name and r.ready for r in discover(client, base_url).routes)
    except (httpx.HTTPError, DiscoveryError):
        return False


def wait_ready(client: httpx.Client, base_url: str, model: ModelInfo, timeout_s: float) -> bool:
    """Poll until `model` (or route) is ready or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if _answers_ready(client, base_url, model):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
