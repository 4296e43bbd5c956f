"""Where each model runs: `placement` per model in AppConfig (auto: co-located on CPU, its own deployment where a
GPU may serve it), refused where it cannot be honoured, and what the local launcher reserves for each."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import AppConfig
from service.launcher import cpus_needed, local_defaults
from service.stage_profile import classify, stage_shares

NAMES = ["mha-h2-d32", "mha-h4-d32"]


@pytest.mark.parametrize(
    ("backend", "cluster_gpus", "expected"),
    [("cpu", 0, "colocated"), ("cpu", 2, "colocated"), ("auto", 0, "colocated"), ("auto", 1, "deployment")],
)
def test_auto_placement_colocates_cpu_models_and_gives_possible_gpu_models_their_own_deployment(
    backend, cluster_gpus, expected
):
    config = AppConfig(backend=backend)
    assert config.placement_for("mha-h2-d32", cluster_gpus) == expected


def test_a_gpu_backend_is_placed_in_its_own_deployment_even_without_gpus_so_it_can_fail_saying_why():
    config = AppConfig(overrides={"mha-h4-d32": {"backend": "gpu"}})
    assert config.placement_for("mha-h4-d32", 0) == "deployment"
    assert config.placement_for("mha-h2-d32", 0) == "colocated"


def test_an_explicit_placement_wins():
    config = AppConfig(
        backend="auto", deployment={"placement": "colocated"}, overrides={"x": {"placement": "deployment"}}
    )
    assert config.placement_for("mha-h2-d32", 4) == "colocated"
    assert config.placement_for("x", 0) == "deployment"


@pytest.mark.parametrize(
    "config",
    [
        {"deployment": {"placement": "colocated", "backend": "gpu"}},
        {"backend": "gpu", "deployment": {"placement": "colocated"}},
        {"overrides": {"mha-h2-d32": {"placement": "colocated", "backend": "gpu"}}},
    ],
)
def test_colocated_with_a_gpu_backend_is_refused_naming_the_fix(config):
    with pytest.raises(ValidationError, match="gpu needs placement deployment"):
        AppConfig.model_validate(config)


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValidationError, match="placement"):
        AppConfig.model_validate({"deployment": {"placement": "nearby"}})


def test_only_models_in_their_own_deployments_reserve_cpus_locally():
    colocated = AppConfig(deployment={"num_cpus": 3})
    mixed = AppConfig(deployment={"num_cpus": 3}, overrides={"mha-h4-d32": {"placement": "deployment", "num_cpus": 3}})
    assert cpus_needed(colocated, NAMES) == 1  # Serve's controller and proxy
    assert cpus_needed(mixed, NAMES) == 1 + 3


def test_local_defaults_fill_only_what_the_config_leaves_unset():
    filled = local_defaults(AppConfig(), direct=True)
    assert filled.ingress.coalesce and filled.ingress.num_replicas == 1
    assert 1 <= filled.deployment.intra_op_threads <= 4
    kept = local_defaults(AppConfig(deployment={"intra_op_threads": 3}, ingress={"coalesce": False}), direct=False)
    assert kept.deployment.intra_op_threads == 3 and not kept.ingress.coalesce


def test_ingress_autoscaling_becomes_serve_autoscaling_options():
    config = AppConfig(ingress={"autoscaling": {"min_replicas": 2, "max_replicas": 6}})
    options = config.ingress.scaling()
    assert options["num_replicas"] == "auto" and options["autoscaling_config"]["max_replicas"] == 6
    assert AppConfig().ingress.scaling() == {"num_replicas": 1}


def test_a_profile_sample_counts_for_its_innermost_recognised_stage():
    outer = "Thread.run (threading.py:982)"
    assert classify([outer, "DynamicBatcher._drain (service/batching.py:150)", "Session.run (onnxruntime/x.py:1)"]) == (
        "ORT run"
    )
    assert classify(["FrontDoor.__call__ (service/asgi.py:70)", "Counter.inc (ray/util/metrics.py:9)"]) == "metrics"
    assert classify(["main (x.py:1)"]) == "other"
    raw = f"{outer};Session.run (onnxruntime/a.py:1) 3\n{outer};Route.matches (starlette/routing.py:2) 1\n"
    assert stage_shares(raw) == {"ORT run": 0.75, "FastAPI / Starlette": 0.25}
