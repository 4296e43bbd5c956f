"""`build_app(args)`: the one application builder, named by `import_path: service.app:build_app` and used by the CLI.

The ingress, holding the co-located models' engines, bound to the handles of the models placed in their own
deployments (named after the model). No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from ray.serve.deployment import Application

from service.config import INGRESS_NAME, AppConfig
from service.deployment import decoder_deployment, model_deployment
from service.ingress import Ingress
from service.model_store import find_models, is_decoder
from service.routes import RouteTable
from service.serve_control import FAILED, ingress_user_config


def gpu_share(backend: str, cluster_gpus: float, n_models: int) -> float:
    """GPUs per replica when not set: 0 on cpu (or without GPUs in the cluster), else a share of the cluster's GPUs.

    `gpu` on a cluster without GPUs still gets 0, so the replica starts and fails saying why, instead of pending.
    """
    if backend == "cpu" or cluster_gpus <= 0:
        return 0.0
    return min(1.0, cluster_gpus / n_models)


def ingress_gpus(config: AppConfig, colocated: list[str], cluster_gpus: float) -> float:
    """GPUs per ingress replica: `ingress.num_gpus`, else, for serving processes on their own ports with a co-located
    model that may use a GPU, a share of the node's (each runs its GPU models in-process: no Ray call per batch).
    Behind Serve's proxies only as set: there GPU models get deployments of their own."""
    ingress = config.ingress
    if ingress.num_gpus is not None:
        return ingress.num_gpus
    if not ingress.on_own_ports or not any(config.may_use_gpu(name, cluster_gpus) for name in colocated):
        return 0.0
    return gpu_share("gpu", cluster_gpus, ingress.process_count())


def build_app(args: AppConfig | dict[str, Any] | None = None) -> Application:
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    models_dir = str(Path(config.models_dir).resolve())  # replicas may not share the builder's working directory
    names = find_models(models_dir, config.models)
    RouteTable.build(config.routes, names)  # a route that cannot be served fails the start (or redeploy) here
    cluster_gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    ingress = config.ingress
    if ingress.on_own_ports and ingress.processes is None:  # resolved here, once: every replica reads the same
        ingress = ingress.model_copy(update={"processes": ingress.process_count()})
    config = config.model_copy(update={"models_dir": models_dir, "ingress": ingress})
    colocated = [n for n in names if config.placement_for(n, cluster_gpus) == "colocated"]
    remote = {}
    for name in (n for n in names if n not in colocated):
        settings, backend = config.settings_for(name), config.backend_for(name)
        n_remote = len(names) - len(colocated)
        gpus = settings.num_gpus if settings.num_gpus is not None else gpu_share(backend, cluster_gpus, n_remote)
        if is_decoder(models_dir, name):
            remote[name] = decoder_deployment(name, models_dir, settings, config.generate.settings(backend), gpus)
        else:
            remote[name] = model_deployment(name, models_dir, backend, settings, gpus)
    ingress = config.ingress
    return Ingress.options(
        name=INGRESS_NAME,
        **ingress.scaling(),
        ray_actor_options={"num_cpus": ingress.num_cpus, "num_gpus": ingress_gpus(config, colocated, cluster_gpus)},
        max_ongoing_requests=ingress.max_ongoing_requests,
        max_queued_requests=ingress.max_queued_requests,
        health_check_period_s=ingress.health_check_period_s,
        user_config=ingress_user_config(config),
    ).bind(remote, colocated, config)


def failure_reasons(app_name: str) -> dict[str, str]:
    """Deployment name -> Serve's message for each deployment of `app_name` that failed (e.g. a BackendError)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {name: d.message for name, d in app.deployments.items() if str(d.status).split(".")[-1] in FAILED}
