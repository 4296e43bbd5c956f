"""The application the faults hit: deploy/serve_config.yaml adapted to two small models on two nodes (A co-located in
the ingress, B in its own deployment, one replica of each per node), and what each node must advertise for that."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.cluster import head_only_config

APP = "mha"  # the application's name in deploy/serve_config.yaml


INGRESS = "ingress"  # service.config.INGRESS_NAME (not imported: service.config would bring pydantic's import time)


REPLICAS = 2  # of the ingress and of B: one per node


CPU_TEMPLATE, GPU_TEMPLATE = "mha-h1-d512", "mha-h8-d512"  # real head configurations whose settings A and B take


def faults_config(models_dir: Path, model_a: str, model_b: str, http_port: int, grpc_port: int) -> dict:
    """deploy/serve_config.yaml on this machine: A takes a real CPU head configuration's settings (co-located in the
    ingress), B a real GPU one's in its own deployment (backend auto: no CUDA here); the ingress and B at REPLICAS
    fixed replicas each (no autoscaling: a target to be back at), B's replicas asking for a whole logical GPU each;
    the proxies on the head (as the cluster test)."""
    config = head_only_config(http_port, grpc_port)
    (app,) = config["applications"]
    args = app["args"]
    templates = args["overrides"]
    args["models_dir"] = str(models_dir.resolve())
    args["models"] = [model_a, model_b]
    ingress = {k: v for k, v in args["ingress"].items() if k != "autoscaling"}
    args["ingress"] = {**ingress, "num_replicas": REPLICAS}
    b = {**templates[GPU_TEMPLATE], "backend": "auto", "num_replicas": REPLICAS, "num_gpus": 1}
    args["overrides"] = {model_a: templates[CPU_TEMPLATE], model_b: b}
    return config


def node_resources(config: dict) -> tuple[float, float]:
    """(CPUs, GPUs) each node advertises: one ingress replica and one replica of B exactly. Two ingress replicas
    do not fit on one node (CPUs), nor two of B (one logical GPU): Ray must put one of each on each node."""
    args = config["applications"][0]["args"]
    ingress, b = args["ingress"], args["overrides"][args["models"][1]]
    assert b["placement"] == "deployment" and args["overrides"][args["models"][0]]["placement"] == "colocated"
    assert ingress["num_cpus"] > b["num_cpus"] / 2 and b["num_gpus"] == 1, "the placement relies on these"
    return ingress["num_cpus"] + b["num_cpus"], b["num_gpus"]


def targets(config: dict) -> dict[str, int]:
    args = config["applications"][0]["args"]
    return {
        INGRESS: args["ingress"]["num_replicas"],
        args["models"][1]: args["overrides"][args["models"][1]]["num_replicas"],
    }
