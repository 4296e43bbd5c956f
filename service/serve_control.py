"""The application's Serve config, applied to the running Serve as `serve deploy CONFIG_FILE` applies it.

Declarative, so that a redeploy that changes only the ingress's user_config (its routes, its loaded models, a drain)
is applied in place (`Ingress.reconfigure`, no replica replaced); `serve.run` gives every deployment a new version on
each call, which replaces every replica. Serve's Python API has no public call for this: Serve's controller client,
reached as `serve deploy` reaches it, is used in this module only (ray is pinned in pyproject.toml;
tests/test_routes.py checks that a redeploy keeps the replica). The launcher deploys through it, and a serving process
applies the model repository's changes to every process through it (service/repository.py). No torch.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ray.serve.schema import ServeDeploySchema

from service.config import INGRESS_NAME, AppConfig

IMPORT_PATH = "service.app:build_app"
FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


def ingress_user_config(config: AppConfig, models: dict[str, int] | None = None) -> dict[str, Any]:
    """The ingress's user_config at a first deploy: the routes, and the co-located models (name -> generation,
    service/repository.py) when given, which Serve changes in place on a redeploy that changes nothing else (a change
    there is not a change of the application's code version)."""
    routes = {"routes": {name: route.model_dump() for name, route in config.routes.items()}}
    return routes if models is None else {**routes, "models": models}


def deploy_schema(
    name: str,
    config: AppConfig,
    logging_config: dict[str, Any],
    models: dict[str, int] | None = None,
    stop_notice: str | None = None,
) -> ServeDeploySchema:
    """The Serve config of one application: `config` as build_app's args, except its routes and models
    (user_config), with the local launcher's stop notices' socket (service/stop_notice.py) when given."""
    user_config = ingress_user_config(config, models)
    if stop_notice is not None:
        user_config["stop_notice"] = stop_notice
    app = {
        "name": name,
        "route_prefix": "/",
        "import_path": IMPORT_PATH,
        "args": config.model_dump(mode="json", exclude={"routes"}),
        "deployments": [{"name": INGRESS_NAME, "user_config": user_config}],
        "logging_config": logging_config,
    }
    return ServeDeploySchema.model_validate({"applications": [app]})


def deploy(
    name: str,
    config: AppConfig,
    logging_config: dict[str, Any],
    models: dict[str, int] | None = None,
    stop_notice: str | None = None,
) -> None:
    """Deploy the application to the running Serve (started with `serve.start`); returns at once."""
    _client().deploy_apps(deploy_schema(name, config, logging_config, models, stop_notice))


def update_ingress(name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """Apply `changes` to the ingress's user_config of the running application `name` (a key set to None is
    removed), every other setting of every application as deployed; returns once Serve has taken it (the replicas
    reconfigure after), with the new user_config."""
    client = _client()
    deployed = {
        app_name: details["deployed_app_config"]
        for app_name, details in client.get_serve_details().get("applications", {}).items()
        if details.get("deployed_app_config")
    }
    if name not in deployed:
        raise RuntimeError(f"application {name!r} is not deployed from a config")
    app = dict(deployed[name])
    entries = [dict(d) for d in app.get("deployments") or []]
    entry = next((d for d in entries if d.get("name") == INGRESS_NAME), None)
    if entry is None:
        entry = {"name": INGRESS_NAME}
        entries.append(entry)
    merged = {**(entry.get("user_config") or {}), **changes}
    entry["user_config"] = {key: value for key, value in merged.items() if value is not None}
    deployed[name] = {**app, "deployments": entries}
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": list(deployed.values())}))
    return entry["user_config"]


def deployed_ingress_config(name: str) -> dict[str, Any]:
    """The ingress's user_config as deployed now ({} when none)."""
    details = _client().get_serve_details().get("applications", {}).get(name) or {}
    for entry in (details.get("deployed_app_config") or {}).get("deployments") or []:
        if entry.get("name") == INGRESS_NAME:
            return dict(entry.get("user_config") or {})
    return {}


def wait_running(
    name: str, poll_s: float = 0.2, deadline: float | None = None, stop: threading.Event | None = None
) -> bool:
    """Block until the application runs (after a deploy, once every replica has taken the new config: Serve marks
    the application deploying while it applies one); False past `deadline` (time.monotonic()) or once `stop` is set,
    RuntimeError with Serve's message if it fails to deploy."""
    from ray import serve

    stop = stop or threading.Event()
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        app = serve.status().applications.get(name)
        status = str(app.status).split(".")[-1] if app is not None else ""
        if status == "RUNNING":
            return True
        if status in FAILED:
            raise RuntimeError(app.message or f"application {name!r} is {status}")
        stop.wait(poll_s)
    return False


def _client():
    from ray.serve.context import _get_global_client

    return _get_global_client()
