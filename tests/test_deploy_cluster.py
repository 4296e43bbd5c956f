"""A real two-node Ray cluster on this machine, deployed like KubeRay does it: `serve deploy` of
deploy/serve_config.yaml (adapted to tiny models), with the pods' Ray settings (Serve's HAProxy ingress among them),
requests to every head configuration (HTTP and gRPC through HAProxy), the limits' answers through it, placement by Ray
resources (the second node advertises a logical GPU, standing in for a GPU
worker), and recovery after that node is killed and comes back. Only processes this test starts are stopped, by
PID, at the end. The cluster itself is benchmarks/harness/cluster.py, which benchmarks/cluster_faults/ drives too.
"""

from __future__ import annotations

import http.client
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import v2_tensor

from benchmarks.harness.cluster import LocalCluster, head_only_config
from benchmarks.harness.polling import until
from benchmarks.harness.processes import command_line
from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from service.haproxy_nosplice import NO_SPLICE
from service.limits import MAX_BODY_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.serve]

STEP_TIMEOUT_S = 240.0  # each wait below (start, deploy, recover) is bounded by this
GPU_MODEL, CPU_MODEL = "mha-h4-d32", "mha-h2-d32"  # the conftest's tiny models
GPU_TEMPLATE, CPU_TEMPLATE = "mha-h8-d512", "mha-h1-d512"  # real head configurations whose settings they take


def wait_for(what: str, check: Callable[[], object], timeout_s: float = STEP_TIMEOUT_S, cluster=None):
    """`until`; where it times out on `cluster`, the error also says what Ray and Serve reported (`serve_state`)."""
    try:
        return until(what, check, timeout_s)
    except TimeoutError as exc:
        if cluster is None:
            raise
        raise TimeoutError(f"{exc}; the cluster reported: {serve_state(cluster)}") from exc


def serve_state(cluster: LocalCluster) -> object:
    """The nodes' `ray start` processes that ended (with their exit codes), the alive nodes, and each deployment's
    status, message and replicas' states and nodes; or why Ray or Serve could not be asked."""
    ended = {n.name: n.proc.returncode for n in cluster.nodes if n.proc.poll() is not None}
    try:
        alive = [n["node_id"][:8] for n in cluster.alive_nodes()]
        deployments = cluster.serve_details()["applications"]["mha"]["deployments"]
    except (httpx.HTTPError, KeyError) as exc:
        return {"ended": ended, "asking Ray": repr(exc)}
    replicas = {
        name: (d["status"], d.get("message", "")[:300], [(r["state"], r["node_id"][:8]) for r in d["replicas"]])
        for name, d in deployments.items()
    }
    return {"ended": ended, "alive nodes": alive, "deployments": replicas}


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    root = Path(tempfile.mkdtemp(prefix="rdc", dir="/tmp"))  # short: Ray's socket paths live under it
    local = LocalCluster(root)
    try:
        yield local
    finally:
        local.stop()
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in root.glob("*.log")}
        if any("Traceback" in text or "Error" in text for text in logs.values()):
            print("ray start logs:", logs)
        shutil.rmtree(root, ignore_errors=True)


# ---- the application ----
def adapted_serve_config(models_dir: Path, http_port: int, grpc_port: int) -> dict:
    """deploy/serve_config.yaml with only what a one-machine run must change: the models (two tiny ones taking
    the settings of one real GPU and one real CPU head configuration), the GPU one's backend (no CUDA here), and the
    HTTP and gRPC proxies on the head only (two nodes on one host cannot both listen on one port)."""
    config = head_only_config(http_port, grpc_port)
    (app,) = config["applications"]
    args = app["args"]
    overrides = args["overrides"]
    args["models_dir"] = str(models_dir)
    args["models"] = [CPU_MODEL, GPU_MODEL]
    # The stand-in GPU node has a logical GPU only (no CUDA here): the GPU template's `backend: gpu` would rightly
    # refuse to start, so that one model runs `auto` (CPU) on it; its resources and placement stay the template's.
    gpu_settings = {**overrides[GPU_TEMPLATE], "backend": "auto"}
    args["overrides"] = {GPU_MODEL: gpu_settings, CPU_MODEL: overrides[CPU_TEMPLATE]}
    return config


def resources_for(config: dict) -> tuple[float, float, float]:
    """(CPUs the head must advertise, CPUs and GPUs of the GPU node): exactly what the adapted app requests (the
    CPU head configuration is co-located in the ingress replicas, at their autoscaling minimum)."""
    args = config["applications"][0]["args"]
    gpu, cpu, ingress = args["overrides"][GPU_MODEL], args["overrides"][CPU_MODEL], args["ingress"]
    assert cpu["placement"] == "colocated" and gpu["placement"] == "deployment"
    head_cpus = ingress["num_cpus"] * ingress["autoscaling"]["min_replicas"]
    return head_cpus, gpu["num_cpus"] * gpu["num_replicas"], gpu["num_gpus"] * gpu["num_replicas"]


def predict(cluster: LocalCluster, model: str, text: str = "heads in a cluster") -> httpx.Response:
    url = f"http://127.0.0.1:{cluster.http_port}/v1/models/{model}/predict"
    return httpx.post(url, json={"text": text}, timeout=10)


def model_ready(cluster: LocalCluster, model: str) -> int | None:
    """The status of the model's v2 readiness (200 ready, 503 not), None where the way in did not answer."""
    try:
        return httpx.get(f"http://127.0.0.1:{cluster.http_port}/v2/models/{model}/ready", timeout=20).status_code
    except httpx.HTTPError:
        return None


class NotAnswered(Exception):
    """The model's answer was not a 200: its status and the start of its body."""


def answer(cluster: LocalCluster, model: str) -> dict:
    """The model's 200 answer; otherwise NotAnswered or httpx's error, which a wait reports when it times out."""
    response = predict(cluster, model)
    if response.status_code != 200:
        raise NotAnswered(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def answered(cluster: LocalCluster, model: str) -> dict | None:
    try:
        return answer(cluster, model)
    except (httpx.HTTPError, NotAnswered):
        return None


def check_grpc(cluster: LocalCluster, models: list[str]) -> None:
    """Through the node's way in, with no metadata (one application): each model's ModelInfer logits equal its
    HTTP v2 answer for the same ids, health Check says SERVING, a malformed request is INVALID_ARGUMENT."""
    ids = np.array([[5, 17, 42, 99, 7, 3]], dtype=np.int64)  # (1, T)
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for model in models:
            body = {"inputs": [v2_tensor("input_ids", ids)]}
            url = f"http://127.0.0.1:{cluster.http_port}/v2/models/{model}/infer"
            http = httpx.post(url, json=body, timeout=30).json()["outputs"][0]
            message = pb.ModelInferRequest(model_name=model, raw_input_contents=[ids.tobytes()])
            message.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
            answer = stub.ModelInfer(message, timeout=30)
            logits = np.frombuffer(answer.raw_output_contents[0], dtype="<f4")  # (B * C,)
            assert list(answer.outputs[0].shape) == http["shape"], model
            np.testing.assert_allclose(logits, http["data"], atol=1e-6, err_msg=model)
        bad = pb.ModelInferRequest(model_name=models[0], raw_input_contents=[ids.tobytes()[:12]])
        bad.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(bad, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def check_way_in(cluster: LocalCluster, model: str) -> None:
    """The pods' way in, Serve's HAProxy ingress: HAProxy, without splicing, holds the HTTP port; a head over the
    limit gets the JSON 431 (HAProxy's buffer holds it), a client sending a whole body over the limit before it reads
    gets the JSON 413 (no broken pipe), a gRPC message over the limit RESOURCE_EXHAUSTED."""
    haproxy = command_line(cluster.listener(cluster.http_port)).split()
    assert Path(haproxy[0]).name == "haproxy" and haproxy[1] == NO_SPLICE, haproxy  # mha-serving-haproxy's
    big_head = httpx.get(f"http://127.0.0.1:{cluster.http_port}/v2", headers={"x-big": "a" * 70_000}, timeout=10)
    assert big_head.status_code == 431 and "over the limit" in big_head.json()["error"], big_head.text[:200]
    body = b"\0" * (MAX_BODY_BYTES * 4)  # well past what a socket buffers: the server must read it to answer
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
    connection.request("POST", f"/v2/models/{model}/infer", body=body, headers={"content-type": "application/json"})
    refused = connection.getresponse()
    assert refused.status == 413 and b"over the limit" in refused.read()
    connection.close()
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        message = pb.ModelInferRequest(model_name=model, raw_input_contents=[body])
        with pytest.raises(grpc.RpcError) as too_big:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=30)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, too_big.value.details()


def placement(cluster: LocalCluster) -> dict[str, set[str]]:
    """Deployment -> ids of the nodes its running replicas are on."""
    return {name: {r["node_id"] for r in replicas} for name, replicas in cluster.replicas("mha").items()}


def test_serve_config_deploys_on_two_nodes_places_by_resources_and_recovers_a_lost_node(cluster, tiny_models_dir):
    config = adapted_serve_config(tiny_models_dir, cluster.http_port, cluster.grpc_port)
    head_cpus, gpu_node_cpus, gpu_node_gpus = resources_for(config)
    assert gpu_node_gpus > 0
    cluster.start_alive("head", cpus=head_cpus, gpus=0, head=True)
    cluster.start_alive("gpu-node", cpus=gpu_node_cpus, gpus=gpu_node_gpus)
    assert len(cluster.alive_nodes()) == 2

    deploy = cluster.deploy(config)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr

    # every head configuration answers, through the one proxy, with the model it was asked for
    first = {
        m: wait_for(f"{m} to answer", lambda m=m: answer(cluster, m), cluster=cluster) for m in (CPU_MODEL, GPU_MODEL)
    }
    for model, body in first.items():
        assert body["model"] == model and len(body["logits"][0]) == len(body["labels"])
    check_grpc(cluster, [CPU_MODEL, GPU_MODEL])
    check_way_in(cluster, CPU_MODEL)

    # placement: the GPU head configuration in its own deployment on the node with the (logical) GPU; the CPU one
    # co-located in the ingress replicas (no deployment of its own), which run on the head
    nodes = {n["node_id"]: n for n in cluster.alive_nodes()}
    gpu_nodes = {i for i, n in nodes.items() if n["resources_total"].get("GPU", 0) > 0}
    head_nodes = {i for i, n in nodes.items() if n["is_head_node"]}
    where = placement(cluster)
    assert where[GPU_MODEL] and where[GPU_MODEL] <= gpu_nodes, (where, nodes)
    assert CPU_MODEL not in where, (where, nodes)
    assert where["ingress"] and where["ingress"] <= head_nodes, (where, nodes)

    # lose the GPU node: its head configuration is reported not ready, the others keep answering. Readiness, not
    # a request left waiting: HAProxy 2.8.25 spins a core on a client gone before its answer (docs/deploy.md), and
    # a request for a model without a replica waits for one.
    (lost,) = [n for n in cluster.nodes if n.name == "gpu-node"]
    cluster.kill(lost)
    wait_for("the GPU node to be seen as dead", lambda: len(cluster.alive_nodes()) == 1)
    wait_for(f"{GPU_MODEL} to be reported not ready", lambda: model_ready(cluster, GPU_MODEL) == 503, timeout_s=60)
    assert answered(cluster, CPU_MODEL) is not None, "the CPU head configuration must survive the GPU node's loss"

    # the node comes back (a new pod): Serve places the replica there again and the same model answers the same
    cluster.start_alive("gpu-node-2", cpus=gpu_node_cpus, gpus=gpu_node_gpus)
    wait_for(f"{GPU_MODEL} to be ready again", lambda: model_ready(cluster, GPU_MODEL) == 200, cluster=cluster)
    again = wait_for(f"{GPU_MODEL} to answer again", lambda: answer(cluster, GPU_MODEL), cluster=cluster)
    # alike to float32 rounding: a retried request may have shared a batch (another GEMM shape) with its predecessor
    assert again["logits"][0] == pytest.approx(first[GPU_MODEL]["logits"][0], rel=1e-4, abs=1e-6)
    nodes = {n["node_id"]: n for n in cluster.alive_nodes()}
    new_gpu_nodes = {i for i, n in nodes.items() if n["resources_total"].get("GPU", 0) > 0}
    assert new_gpu_nodes and not (new_gpu_nodes & gpu_nodes), "the replacement node is a new Ray node"
    assert placement(cluster)[GPU_MODEL] <= new_gpu_nodes
