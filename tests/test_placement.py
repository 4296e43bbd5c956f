"""Where each model runs: `placement` per model in AppConfig (auto: co-located on CPU, its own deployment where a
GPU may serve it), refused where it cannot be honoured, and what the local launcher reserves for each."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from benchmarks.serving.stages import UNSAMPLED, classify, stage_shares
from contract.metadata import ModelMetadata
from service.app import ingress_gpus
from service.batching import BatchPolicy
from service.config import AppConfig, default_processes
from service.deployment import REFUSING_SLOTS, decoder_limits
from service.engine import LIGHT_MODEL_FLOPS, EngineSettings, flops_per_token
from service.generate import GenerationSettings
from service.limits import RequestLimits
from service.local.launcher import cpus_needed

NAMES = ["mha-h2-d32", "mha-h4-d32"]


@pytest.mark.parametrize(
    ("backend", "cluster_gpus", "expected"),
    [("cpu", 0, "colocated"), ("cpu", 2, "colocated"), ("auto", 0, "colocated"), ("auto", 1, "deployment")],
)
def test_auto_placement_behind_serves_proxies_colocates_cpu_models_and_gives_possible_gpu_models_a_deployment(
    backend, cluster_gpus, expected
):
    config = AppConfig(backend=backend)
    assert config.placement_for("mha-h2-d32", cluster_gpus) == expected


@pytest.mark.parametrize("backend", ["cpu", "auto", "gpu"])
def test_auto_placement_on_the_ingresss_own_ports_colocates_every_model_gpu_ones_included(backend):
    config = AppConfig(backend=backend, ingress={"port": 8000})
    assert config.placement_for("mha-h2-d32", cluster_gpus=1) == "colocated"


def test_a_gpu_backend_behind_serves_proxies_gets_its_own_deployment_even_without_gpus_so_it_can_fail_saying_why():
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
    ("ingress", "cluster_gpus", "expected"),
    [
        ({"port": 8000, "processes": 4}, 1, 0.25),  # each serving process a quarter of the node's GPU
        ({"port": 8000, "processes": 2}, 4, 1.0),  # at most one GPU each
        ({"port": 8000, "processes": 2}, 0, 0.0),  # no GPU: the engines say why at start
        ({"port": 8000, "processes": 2, "num_gpus": 0.5}, 4, 0.5),  # set: as set
        ({"num_replicas": 2}, 1, 0.0),  # behind Serve's proxies: only as set (GPU models get deployments there)
        ({"num_replicas": 2, "num_gpus": 0.5}, 1, 0.5),
    ],
)
def test_serving_processes_with_co_located_gpu_models_get_a_share_of_the_gpus(ingress, cluster_gpus, expected):
    config = AppConfig(backend="gpu", deployment={"placement": "colocated"}, ingress=ingress)
    assert ingress_gpus(config, ["mha-h2-d32"], cluster_gpus) == expected


def test_serving_processes_without_a_co_located_gpu_model_get_no_gpu():
    config = AppConfig(backend="cpu", ingress={"port": 8000, "processes": 2})
    assert ingress_gpus(config, ["mha-h2-d32"], cluster_gpus=2) == 0.0


def test_a_decoders_replica_holds_what_its_engine_holds_and_takes_a_few_more_for_its_engine_to_refuse():
    """Serve's queue is never where a decoder's request waits: its engine's queue is (queue_timeout_s, the gauge)."""
    limits = decoder_limits(GenerationSettings(max_running=32, max_waiting=100))
    assert limits == {"max_ongoing_requests": 132 + REFUSING_SLOTS, "max_queued_requests": 132}


def test_generations_share_of_the_in_flight_limit_is_three_quarters_by_default_and_at_most_all_of_it():
    assert RequestLimits().generation_in_flight == 768 and RequestLimits(max_in_flight=300).generation_in_flight == 225
    assert RequestLimits(max_in_flight=1).generation_in_flight == 1
    assert AppConfig(limits={"max_in_flight": 300, "max_generation_in_flight": 300}).limits.generation_in_flight == 300
    with pytest.raises(ValidationError, match="max_generation_in_flight"):
        AppConfig(limits={"max_in_flight": 300, "max_generation_in_flight": 301})


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValidationError, match="placement"):
        AppConfig.model_validate({"deployment": {"placement": "nearby"}})


def test_only_models_in_their_own_deployments_reserve_cpus_locally():
    colocated = AppConfig(deployment={"num_cpus": 3})
    mixed = AppConfig(deployment={"num_cpus": 3}, overrides={"mha-h4-d32": {"placement": "deployment", "num_cpus": 3}})
    assert cpus_needed(colocated, NAMES) == 1  # Serve's controller and proxy
    assert cpus_needed(mixed, NAMES) == 1 + 3


def test_ort_threads_default_to_every_core_up_to_four_co_located_and_to_num_cpus_in_a_deployment():
    import os

    settings = AppConfig(deployment={"num_cpus": 3}).deployment
    assert settings.threads("colocated") == max(1, min(os.cpu_count() or 1, 4))
    assert settings.threads("deployment") == 3
    assert AppConfig(deployment={"intra_op_threads": 5}).deployment.threads("colocated") == 5
    assert AppConfig().deployment.light_model_threads == 1 and AppConfig().ingress.coalesce


def test_the_replicas_on_the_ingresss_own_ports_are_its_processes_and_num_replicas_is_for_serves_proxy():
    assert AppConfig(ingress={"port": 8000, "processes": 3}).ingress.scaling() == {"num_replicas": 3}
    assert AppConfig(ingress={"grpc_port": 8001, "processes": 2}).ingress.scaling() == {"num_replicas": 2}
    assert AppConfig(ingress={"num_replicas": 4, "processes": 3}).ingress.scaling() == {"num_replicas": 4}
    for ingress in ({"port": 8000, "num_replicas": 2}, {"port": 8000, "autoscaling": {"max_replicas": 2}}):
        with pytest.raises(ValidationError, match="the replicas on the ingress's own ports are `processes`"):
            AppConfig(ingress=ingress)


@pytest.mark.parametrize(("cpus", "processes"), [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8)])
def test_a_node_gets_one_serving_process_per_two_cores_by_default(cpus, processes):
    assert default_processes(cpus) == processes


def test_co_located_models_share_the_cores_among_the_serving_processes():
    settings = AppConfig().deployment
    one, two = settings.threads("colocated"), settings.threads("colocated", processes=2)
    assert two == max(1, min(one, (os.cpu_count() or 1) // 2))


def _meta(d_model: int, layers: int) -> ModelMetadata:
    return ModelMetadata(
        name="m", heads=4, head_dim=d_model // 4, d_model=d_model, layers=layers, vocab_size=260, max_len=64,
        num_classes=2, labels=("a", "b"), ff_dim=4 * d_model,
    )  # fmt: skip


def test_a_light_model_on_cpu_runs_on_the_light_thread_count_and_a_heavy_one_on_every_thread():
    small, default = _meta(128, 2), _meta(512, 4)  # the benchmark's two models
    assert flops_per_token(small) < LIGHT_MODEL_FLOPS < flops_per_token(default)
    settings = EngineSettings("auto", 4, BatchPolicy(), light_threads=1)
    assert settings.threads_for(small, "cpu") == 1
    assert settings.threads_for(default, "cpu") == 4
    assert settings.threads_for(small, "gpu") == 4  # the CUDA provider's CPU threads feed the GPU: left alone
    assert EngineSettings("auto", 4, BatchPolicy()).threads_for(small, "cpu") == 4  # light_threads None: no rule


def test_lone_runs_are_inline_on_the_gpu_only_when_asked_and_gpu_settings_reach_the_engine():
    policy = BatchPolicy(inline_max_s=0.02)
    plain = EngineSettings("gpu", 1, policy)
    assert plain.policy_for(1, "cpu").inline_max_s == 0.02 and plain.policy_for(1, "gpu").inline_max_s == 0.0
    asked = EngineSettings("gpu", 1, policy, inline_on_gpu=True)
    assert asked.policy_for(1, "gpu").inline_max_s == 0.02 and asked.policy_for(1, "gpu").max_runs == 1
    settings = AppConfig(deployment={"gpu_wait": "block", "inline_on_gpu": True}).deployment
    engine = EngineSettings.of(settings, "gpu", "colocated")
    assert (engine.gpu_wait, engine.inline_on_gpu) == ("block", True)
    assert EngineSettings.of(AppConfig().deployment, "gpu", "colocated").gpu_wait == "auto"


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
    assert classify(["Ingress._measured (service/ingress.py:70)", "Counter.inc (ray/util/metrics.py:9)"]) == "metrics"
    assert classify(["main (x.py:1)"]) == "other"
    raw = f"{outer};Session.run (onnxruntime/a.py:1) 3\n{outer};Route.matches (starlette/routing.py:2) 1\n"
    assert stage_shares(raw) == {"ORT run": 0.75, "FastAPI / Starlette": 0.25}


def test_a_profile_splits_each_threads_cpu_by_its_own_samples_and_leaves_out_samples_of_waits():
    outer = "Thread.run (threading.py:982)"
    raw = (
        f"thread (11): loop;{outer};Session.run (onnxruntime/a.py:1) 3\n"
        f"thread (11): loop;{outer};Route.matches (starlette/routing.py:2) 1\n"
        f"thread (12): worker;{outer};_worker (concurrent/futures/thread.py:81) 40\n"  # waiting for work
        f"thread (12): worker;{outer};merge (service/batching.py:46) 2\n"
        f"thread (14): main;main (x.py:1) 30\n"
    )
    shares = stage_shares(raw, {11: 0.6, 12: 0.1, 13: 0.2, 14: 0.1})  # 13: CPU, never sampled (no Python frame)
    expected = {"ORT run": 0.45, "FastAPI / Starlette": 0.15, "batching": 0.1, "other": 0.1, UNSAMPLED: 0.2}
    assert shares == pytest.approx(expected), shares
    assert stage_shares(raw)["other"] == 30 / 36  # by samples alone, the waits left out
