"""Finding the service and its models over HTTP: the loopback guard, `/v1/models` (or `/v2`), model selection."""

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
class ModelInfo:
    """One served model as the service describes it: its head configuration, precision, backend and readiness."""

    name: str
    heads: int
    head_dim: int
    d_model: int
    layers: int
    max_len: int
    backend: str = ""
    ready: bool = True
    precision: str = DEFAULT_PRECISION
    quantized_from: str = ""  # an int8 or fp16 variant's fp32 source model, e.g. mha-h8-d512

    def to_json(self) -> dict[str, object]:
        return asdict(self)


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
    return ModelInfo(name, **values, backend=backend, ready=ready, precision=precision, quantized_from=quantized_from)


def _listing_entries(listing: object) -> list:
    if isinstance(listing, dict):
        listing = listing.get("models", listing.get("data"))
    if not isinstance(listing, list):
        raise DiscoveryError(f"the service's model listing is not a list of models: {str(listing)[:200]}")
    return listing


def discover(client: httpx.Client, base_url: str) -> list[ModelInfo]:
    """Every model the service serves, from `/v1/models`, else from `/v2` plus `/v2/models/{name}`."""
    try:
        entries = _listing_entries(_get_json(client, f"{base_url}/v1/models"))
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
    return models


def check_extension(client: httpx.Client, base_url: str, extension: str, needed_by: str) -> None:
    """DiscoveryError unless the service's `GET /v2` lists `extension`."""
    server = _get_json(client, f"{base_url}/v2")
    listed = server.get("extensions") if isinstance(server, dict) else None
    if not isinstance(listed, list) or extension not in listed:
        raise DiscoveryError(
            f"the service at {base_url} does not list the {extension} extension that {needed_by} needs "
            f"(GET /v2 lists {listed})"
        )


def select_models(models: list[ModelInfo], spec: str) -> list[ModelInfo]:
    """`all` (by d_model, h, then precision: each int8 variant right after its fp32 source) or a comma-separated
    list of names, in the order asked; DiscoveryError names unknown ones."""
    if spec.strip() == "all":
        return sorted(models, key=lambda m: (m.d_model, m.heads, precision_rank(m.precision), m.name))
    by_name = {m.name: m for m in models}
    wanted = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        asked = ", ".join(unknown) if unknown else repr(spec)
        raise DiscoveryError(f"unknown model(s) {asked}; the service serves: {', '.join(sorted(by_name))}")
    return [by_name[n] for n in wanted]


def wait_ready(client: httpx.Client, base_url: str, name: str, timeout_s: float) -> bool:
    """Poll `/v2/models/{name}/ready` until it answers 200 or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get(f"{base_url}/v2/models/{name}/ready").status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
