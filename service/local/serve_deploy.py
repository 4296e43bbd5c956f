"""Deploying the application to the local Serve as a config, as Ray's own `serve run CONFIG_FILE` does.

Declarative, so that a redeploy that changes only the ingress's user_config (its routes) is applied in place
(`Ingress.reconfigure`, no replica replaced); `serve.run` gives every deployment a new version on each call, which
replaces every replica. Serve's Python API has no public call for this: Serve's client, reached as `serve run` reaches
it, is used here only (ray is pinned in pyproject.toml; tests/test_routes.py checks that a redeploy keeps the
replica). No torch.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.schema import ServeDeploySchema

from service.app import routes_config
from service.config import INGRESS_NAME, AppConfig

IMPORT_PATH = "service.app:build_app"
FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


def deploy_schema(
    name: str, config: AppConfig, logging_config: dict[str, Any], drain_until: float | None = None
) -> ServeDeploySchema:
    """The Serve config of one application: `config` as build_app's args, except its routes (and `drain_until`),
    which go to the ingress's user_config (a change there is not a change of the application's code version)."""
    app = {
        "name": name,
        "route_prefix": "/",
        "import_path": IMPORT_PATH,
        "args": config.model_dump(mode="json", exclude={"routes"}),
        "deployments": [{"name": INGRESS_NAME, "user_config": routes_config(config, drain_until)}],
        "logging_config": logging_config,
    }
    return ServeDeploySchema.model_validate({"applications": [app]})


def deploy(name: str, config: AppConfig, logging_config: dict[str, Any], drain_until: float | None = None) -> None:
    """Apply the application's config to the running Serve (started with `serve.start`); returns at once.
    `drain_until`: every ingress replica drains, its reconfigure waiting for its requests in progress up to then."""
    from ray.serve.context import _get_global_client

    _get_global_client().deploy_apps(deploy_schema(name, config, logging_config, drain_until))


def wait_running(name: str, poll_s: float = 0.2, deadline: float | None = None) -> bool:
    """Block until the application runs (after a `deploy`, once every replica has taken the new config: Serve
    marks the application deploying while it applies one); False past `deadline` (time.monotonic()), RuntimeError
    with Serve's message if it fails to deploy."""
    from ray import serve

    while deadline is None or time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        status = str(app.status).split(".")[-1] if app is not None else ""
        if status == "RUNNING":
            return True
        if status in FAILED:
            raise RuntimeError(app.message or f"application {name!r} is {status}")
        time.sleep(poll_s)
    return False
