"""The Open Inference Protocol over gRPC through Ray Serve's gRPC proxy (the cluster's way in: no gRPC server in the
ingress replica): tritonclient.grpc and our own stubs, raw and typed contents, the typed errors' status codes and
messages, grpc.health.v1, and the metrics' `grpc_infer` endpoint, answered by the same code as the in-replica server.

The session's Serve holds several applications, so every call names its application in the `application` metadata
key, as Serve's proxy asks then; with one application (a cluster's) none is needed (tests/test_deploy_cluster.py).
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import bare_logits, deployed, free_port, in_own_process, serve_command, v2_tensor

from contract.rpc import generation_pb2 as gen
from contract.rpc import generation_pb2_grpc as gen_grpc
from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from contract.tokenizer import ByteTokenizer
from service.config import AppConfig
from service.local.launcher import LocalServe, local_config

NAME = "mha-h4-d32"
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def app(serve_port, tiny_models_dir):
    """The tiny models without an in-replica gRPC server, with a small body limit."""
    with deployed(serve_port, "grpc-proxy", tiny_models_dir, "colocated", limits={"max_body_bytes": MAX_BODY_BYTES}):
        yield "grpc-proxy"


@pytest.fixture
def channel(serve_grpc_port):
    with grpc.insecure_channel(f"127.0.0.1:{serve_grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


@pytest.fixture
def stub(channel):
    return pb_grpc.GRPCInferenceServiceStub(channel)


def _metadata(app: str) -> tuple:
    return (("application", app),)


def _ids(seed: int, shape=(3, 6)) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 260, size=shape).astype(np.int64)  # (B, T)


def _raw(shape: list[int], data: bytes, datatype: str = "INT64", model: str = NAME) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="input_ids", datatype=datatype, shape=shape)
    message.raw_input_contents.append(data)
    return message


def _logits(answer: pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(list(answer.outputs[0].shape))


TRITON_INFER = """
import json, sys
import numpy as np
import tritonclient.grpc as triton

url, app, name, ids, texts = sys.argv[1], sys.argv[2], sys.argv[3], *map(json.loads, sys.argv[4:])
headers = {"application": app}
client = triton.InferenceServerClient(url=url)
out = {"live": client.is_server_live(headers=headers), "ready": client.is_server_ready(headers=headers)}
out["model_ready"] = client.is_model_ready(name, headers=headers)
out["platform"] = client.get_model_metadata(name, headers=headers).platform
tensor = triton.InferInput("input_ids", list(np.shape(ids)), "INT64")
tensor.set_data_from_numpy(np.array(ids, dtype=np.int64))  # the defaults: raw contents
result = client.infer(name, [tensor], request_id="p1", headers=headers)
out["id"], out["ids_logits"] = result.get_response().id, result.as_numpy("logits").tolist()
text = triton.InferInput("text", [len(texts)], "BYTES")
text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
out["text_logits"] = client.infer(name, [text], headers=headers).as_numpy("logits").tolist()
client.close()
print(json.dumps(out))
"""


@pytest.mark.serve
def test_tritonclient_grpc_through_serves_proxy_answers_ids_and_text_like_ort(app, serve_grpc_port, tiny_models_dir):
    ids, texts = _ids(11, (3, 7)), ["through the proxy", "and another text"]
    url = f"127.0.0.1:{serve_grpc_port}"
    out = in_own_process(TRITON_INFER, url, app, NAME, json.dumps(ids.tolist()), json.dumps(texts))
    assert out["live"] and out["ready"] and out["model_ready"] and out["platform"] == "onnxruntime_onnx"
    assert out["id"] == "p1"
    np.testing.assert_allclose(out["ids_logits"], bare_logits(tiny_models_dir, NAME, ids), atol=1e-6)
    want = bare_logits(tiny_models_dir, NAME, *ByteTokenizer(32).encode_batch(texts))
    np.testing.assert_allclose(out["text_logits"], want, atol=1e-6)


@pytest.mark.serve
def test_typed_contents_through_serves_proxy_answer_like_raw_contents(app, stub, tiny_models_dir):
    ids = _ids(12, (2, 5))
    typed = pb.ModelInferRequest(model_name=NAME)
    typed.inputs.add(name="input_ids", datatype="INT64", shape=[2, 5]).contents.int64_contents.extend(ids.ravel())
    want = bare_logits(tiny_models_dir, NAME, ids)
    for message in (typed, _raw([2, 5], ids.tobytes())):
        answer = stub.ModelInfer(message, metadata=_metadata(app), timeout=30)
        np.testing.assert_allclose(_logits(answer), want, atol=1e-6)


@pytest.mark.serve
def test_errors_through_serves_proxy_are_the_same_status_codes_and_messages_and_it_keeps_serving(app, stub):
    ids = _ids(13, (1, 4)).tobytes()
    hostile = {
        "unknown model": (_raw([1, 4], ids, model="mha-nope"), grpc.StatusCode.NOT_FOUND, "unknown model 'mha-nope'"),
        "truncated raw contents": (_raw([1, 4], ids[:20]), grpc.StatusCode.INVALID_ARGUMENT, "not a whole number"),
        "raw size against shape": (_raw([2, 4], ids), grpc.StatusCode.INVALID_ARGUMENT, "needs 8 values"),
        "wrong datatype": (_raw([1, 1], b"\0" * 4, datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT, "FP32"),
        "message over the body limit": (
            _raw([1, MAX_BODY_BYTES], b"\0" * 8 * MAX_BODY_BYTES),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"over the limit of {MAX_BODY_BYTES} bytes",
        ),
    }
    for case, (message, code, text) in hostile.items():
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(message, metadata=_metadata(app), timeout=30)
        assert failed.value.code() == code and text in failed.value.details(), (case, failed.value.details())
    with pytest.raises(grpc.RpcError) as unknown:
        stub.ModelReady(pb.ModelReadyRequest(name=NAME, version="7"), metadata=_metadata(app), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "no version '7'" in unknown.value.details()
    answer = stub.ModelInfer(_raw([1, 4], ids), metadata=_metadata(app), timeout=30)  # still serving
    assert list(answer.outputs[0].shape) == [1, 2]


@pytest.mark.serve
def test_serves_proxy_takes_the_generation_service_and_answers_it_from_the_same_data_plane(app, channel):
    """ModelGenerate through Serve's proxy (its servicer functions list the generation service): refusals come back
    with the replica's own codes and messages, not UNIMPLEMENTED."""
    generate = gen_grpc.GenerationServiceStub(channel).ModelGenerate
    cases = {
        NAME: (grpc.StatusCode.INVALID_ARGUMENT, f"model {NAME!r} is a classifier"),
        "lm-nope": (grpc.StatusCode.NOT_FOUND, "unknown model 'lm-nope'"),
    }
    for model, (code, text) in cases.items():
        request = gen.ModelGenerateRequest(model_name=model, text_input="x")
        with pytest.raises(grpc.RpcError) as failed:
            list(generate(request, metadata=_metadata(app), timeout=30))
        assert failed.value.code() == code and text in failed.value.details(), (model, failed.value.details())


@pytest.mark.serve
def test_with_several_applications_serves_proxy_routes_by_the_application_key_and_refuses_a_call_without_it(
    app, stub, serve_port, tiny_models_dir
):
    other, other_model = "grpc-proxy-other", "mha-h2-d32"
    with deployed(serve_port, other, tiny_models_dir, "colocated", models=[other_model]):
        with pytest.raises(grpc.RpcError) as failed:
            stub.ServerLive(pb.ServerLiveRequest(), timeout=30)
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert "Application metadata not set" in failed.value.details()
        request = pb.ModelMetadataRequest(name=other_model)
        assert stub.ModelMetadata(request, metadata=_metadata(other), timeout=30).name == other_model
        with pytest.raises(grpc.RpcError) as elsewhere:
            stub.ModelMetadata(pb.ModelMetadataRequest(name=NAME), metadata=_metadata(other), timeout=30)
        assert elsewhere.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"unknown model {NAME!r}" in elsewhere.value.details()


@pytest.mark.serve
def test_calls_through_serves_proxy_are_counted_under_the_grpc_endpoint(app, stub, metrics_port):
    stub.ModelInfer(_raw([1, 4], _ids(14, (1, 4)).tobytes()), metadata=_metadata(app), timeout=30)
    with pytest.raises(grpc.RpcError):
        stub.ModelInfer(_raw([1, 4], b"\0" * 3), metadata=_metadata(app), timeout=30)
    wanted = ("ray_mha_requests_total{", 'endpoint="grpc_infer"', f'application="{app}"', f'model="{NAME}"')
    codes: set[str] = set()
    deadline = time.monotonic() + 60
    while codes != {'code="200"', 'code="400"'} and time.monotonic() < deadline:
        lines = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines()
        found = [line for line in lines if all(w in line for w in wanted)]
        codes = {c for line in found for c in ('code="200"', 'code="400"') if c in line}
        time.sleep(1)
    assert codes == {'code="200"', 'code="400"'}


@pytest.mark.serve
def test_grpc_health_watch_through_serves_proxy_is_unimplemented_as_in_the_replica(app, channel):
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(), metadata=_metadata(app), timeout=30)
    with pytest.raises(grpc.RpcError) as refused:
        next(watch)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and "poll Check" in refused.value.details()


@pytest.mark.serve
def test_grpc_health_through_serves_proxy_says_serving_when_ready_and_not_serving_while_draining(app, channel):
    from ray import serve

    health = health_pb2_grpc.HealthStub(channel)
    check = health.Check(health_pb2.HealthCheckRequest(service=""), metadata=_metadata(app), timeout=30)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        health.Check(health_pb2.HealthCheckRequest(service="other"), metadata=_metadata(app), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "unknown service 'other'" in unknown.value.details()
    serve.get_app_handle(app).drain.remote().result(timeout_s=30)  # what SIGTERM starts (the app goes after)
    draining = health.Check(health_pb2.HealthCheckRequest(service=""), metadata=_metadata(app), timeout=30)
    assert draining.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_launcher_serves_grpc_in_the_replica_directly_and_through_serves_proxy_with_proxy(tiny_models_dir):
    config = AppConfig(models_dir=str(tiny_models_dir))
    direct = local_config(config, LocalServe(grpc_port=8101))
    proxied = local_config(config, LocalServe(grpc_port=8101, direct=False))
    assert direct.ingress.grpc_port == 8101 and proxied.ingress.grpc_port is None and proxied.ingress.port is None


@pytest.mark.serve
@pytest.mark.slow
def test_serve_with_proxy_answers_grpc_through_serves_proxy_without_any_metadata(tiny_models_dir, tmp_path):
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    args = ["--models", str(tiny_models_dir), "--proxy", "--port", str(port), "--grpc-port", str(grpc_port)]
    with serve_command([*args, "--metrics-port", str(metrics_port), "--num-cpus", "2"], tmp_path / "log") as summary:
        assert f"127.0.0.1:{grpc_port}" in summary and "gRPC proxy listens on every interface" in summary
        ids = _ids(15, (2, 6))
        body = {"inputs": [v2_tensor("input_ids", ids)]}
        http = httpx.post(f"http://127.0.0.1:{port}/v2/models/{NAME}/infer", json=body, timeout=30).json()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_raw([2, 6], ids.tobytes()), timeout=30)
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert _logits(answer).ravel().tolist() == http["outputs"][0]["data"]
        assert check.status == health_pb2.HealthCheckResponse.SERVING
