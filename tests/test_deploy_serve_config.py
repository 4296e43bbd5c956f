"""deploy/serve_config.yaml: the single source of the cluster application, embedded verbatim by the RayService,
valid for Ray Serve and for the service's AppConfig, one deployment per default head configuration, and placeable.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from contract.metadata import config_name
from contract.settings import DEFAULT_HEADS
from service.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
RAYSERVICE = ROOT / "deploy" / "k8s" / "base" / "rayservice.yaml"
DEFAULT_NAMES = [config_name(h, 512) for h in DEFAULT_HEADS]  # mha-h1-d512 ... mha-h16-d512


def serve_config() -> dict:
    return yaml.safe_load(SERVE_CONFIG.read_text())


def app_args() -> dict:
    (app,) = serve_config()["applications"]
    return app["args"]


def rayservice() -> dict:
    return yaml.safe_load(RAYSERVICE.read_text())


def worker_groups() -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def test_rayservice_embeds_the_serve_config_unchanged():
    embedded = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    assert embedded == serve_config(), "run `python deploy/k8s/embed_serve_config.py` after editing the Serve config"


def test_embed_script_rewrites_only_the_serve_config_block():
    spec = importlib.util.spec_from_file_location("embed", ROOT / "deploy" / "k8s" / "embed_serve_config.py")
    embed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(embed)
    text = RAYSERVICE.read_text()
    assert embed.embedded(text, SERVE_CONFIG.read_text()) == text, "the RayService holds the file verbatim"
    edited = SERVE_CONFIG.read_text().replace("max_batch_size: 64", "max_batch_size: 48")
    rewritten = yaml.safe_load(embed.embedded(text, edited))
    assert yaml.safe_load(rewritten["spec"]["serveConfigV2"]) == yaml.safe_load(edited)
    assert {**rewritten["spec"], "serveConfigV2": ""} == {**rayservice()["spec"], "serveConfigV2": ""}


def test_serve_config_passes_ray_serve_schema_validation():
    schema = ServeDeploySchema.model_validate(serve_config())
    (app,) = schema.applications
    assert app.import_path == "service.app:build_app"
    assert app.route_prefix == "/"


def test_args_validate_against_the_service_app_config():
    config = AppConfig.model_validate(app_args())
    assert config.models == DEFAULT_NAMES
    assert set(config.overrides) == set(DEFAULT_NAMES), "settings and placement per head configuration"
    placements = {n: config.placement_for(n, cluster_gpus=1) for n in DEFAULT_NAMES}
    assert set(placements.values()) == {"colocated", "deployment"}, placements


def ingress_cpus(config: AppConfig, at_most: bool = False) -> float:
    """CPUs the ingress replicas take (at their autoscaling maximum when `at_most`)."""
    ingress = config.ingress
    replicas = ingress.num_replicas
    if ingress.autoscaling is not None:
        replicas = ingress.autoscaling.max_replicas if at_most else ingress.autoscaling.min_replicas
    return ingress.num_cpus * replicas


def test_a_misspelt_setting_in_the_args_is_rejected():
    args = copy.deepcopy(app_args())
    args["overrides"]["mha-h8-d512"]["num_gpu"] = 1
    with pytest.raises(ValidationError, match="num_gpu"):
        AppConfig.model_validate(args)


def test_models_dir_is_where_the_dockerfile_puts_the_models():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"COPY --from=build --chown=1000:100 /models {app_args()['models_dir']}" in dockerfile
    assert "mha-serving export --out /models" in dockerfile


def test_serve_http_and_grpc_ports_are_the_ones_the_serve_service_targets_and_every_pod_exposes():
    http, grpc = serve_config()["http_options"]["port"], serve_config()["grpc_options"]["port"]
    service = rayservice()["spec"]["serveService"]["spec"]
    assert [p["targetPort"] for p in service["ports"]] == [http, grpc]
    for group in [rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"], *worker_groups().values()]:
        (container,) = group["template"]["spec"]["containers"]
        assert {"name": "serve", "containerPort": http} in container["ports"]
        assert {"name": "grpc", "containerPort": grpc} in container["ports"]


def test_serves_grpc_proxy_takes_the_services_the_ingress_answers_and_can_import_them():
    from ray.serve.config import gRPCOptions

    from contract.rpc import inference_pb2 as pb
    from service.ingress import Ingress
    from service.rpc.servicers import SERVE_SERVICERS

    options = gRPCOptions(**serve_config()["grpc_options"])
    assert options.grpc_servicer_functions == SERVE_SERVICERS and len(options.grpc_servicer_func_callable) == 3
    rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods] + ["Check"]
    missing = [m for m in rpcs if not callable(getattr(Ingress.func_or_class, m, None))]
    assert not missing, "Serve's gRPC proxy calls the ingress's method named after the RPC"


def test_serves_grpc_proxy_refuses_messages_over_the_apps_body_limit_on_every_pod():
    limit = AppConfig.model_validate(app_args()).limits.max_body_bytes
    for group in [rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"], *worker_groups().values()]:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert int(env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) == limit


def test_gpu_head_configurations_fit_only_gpu_workers_and_cpu_ones_only_cpu_workers():
    """Ray places a replica on a node whose advertised resources cover its request: check both directions."""
    config = AppConfig.model_validate(app_args())
    groups = worker_groups()
    capacity = {
        name: (float(g["rayStartParams"]["num-cpus"]), float(g["rayStartParams"]["num-gpus"]))
        for name, g in groups.items()
    }
    gpu_models = [n for n in DEFAULT_NAMES if (config.settings_for(n).num_gpus or 0) > 0]
    cpu_models = [n for n in DEFAULT_NAMES if n not in gpu_models]
    assert gpu_models and cpu_models
    assert all(config.placement_for(n, cluster_gpus=1) == "deployment" for n in gpu_models), "GPU replicas of their own"
    gpu_cpus = sum(config.settings_for(n).num_cpus * config.settings_for(n).num_replicas for n in gpu_models)
    gpu_gpus = sum(config.settings_for(n).num_gpus * config.settings_for(n).num_replicas for n in gpu_models)
    assert gpu_gpus <= capacity["gpu-workers"][1], "the GPU head configurations fit one GPU worker"
    assert gpu_cpus <= capacity["gpu-workers"][0]
    leftover_cpus = capacity["gpu-workers"][0] - gpu_cpus
    # the CPU head configurations live in the ingress replicas: those must land on CPU workers only
    assert all(config.placement_for(n, cluster_gpus=1) == "colocated" for n in cpu_models)
    assert config.ingress.num_cpus <= capacity["cpu-workers"][0], "an ingress replica fits a CPU worker"
    assert config.ingress.num_cpus > leftover_cpus, "an ingress replica must not fit the CPUs left on a GPU worker"
    assert capacity["cpu-workers"][1] == 0
    assert config.ingress.num_cpus > 0, "a CPU request keeps the ingress off the head (num-cpus 0)"
    for name in cpu_models:
        assert config.settings_for(name).threads("colocated") <= config.ingress.num_cpus, (
            f"{name}'s ORT threads fit the ingress"
        )


def test_autoscaled_head_configurations_fit_the_cpu_group_at_their_maximum():
    config = AppConfig.model_validate(app_args())
    cpu_group = worker_groups()["cpu-workers"]
    per_pod = float(cpu_group["rayStartParams"]["num-cpus"])
    needed = ingress_cpus(config, at_most=True)
    for name in DEFAULT_NAMES:
        settings = config.settings_for(name)
        if settings.num_gpus or config.placement_for(name, cluster_gpus=1) == "colocated":
            continue
        replicas = settings.autoscaling.max_replicas if settings.autoscaling else settings.num_replicas
        needed += settings.num_cpus * replicas
    assert needed <= per_pod * cpu_group["maxReplicas"]


def test_head_configurations_placed_on_gpu_workers_ask_for_the_gpu_backend_and_the_rest_do_not():
    config = AppConfig.model_validate(serve_config()["applications"][0]["args"])
    for name in DEFAULT_NAMES:
        on_gpu = (config.settings_for(name).num_gpus or 0) > 0
        assert (config.backend_for(name) == "gpu") == on_gpu, name  # a GPU replica never falls back to CPU silently
