"""The Open Inference Protocol over gRPC in the ingress replica: NVIDIA's tritonclient.grpc unchanged (health, metadata,
inference with raw and typed tensor contents), grpc.health.v1, typed errors as gRPC status codes, hostile messages
answered INVALID_ARGUMENT while the server keeps serving, and the stubs in step with the .proto.

tritonclient.grpc runs in a process of its own: its generated modules and ours define the same protocol buffer
messages (`inference.*`), which one process's default descriptor pool takes only once."""

from __future__ import annotations

import filecmp
import inspect
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import bare_logits, deployed, in_own_process

from contract.rpc import generate
from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from contract.tokenizer import ByteTokenizer
from service.local.ports import free_port

NAME = "mha-h4-d32"
MAX_BODY_BYTES = 64 * 1024


def _fields(descriptor) -> dict[str, list]:
    out = {}
    for field in descriptor.fields:
        kind = field.message_type.full_name if field.message_type else field.type
        out[field.name] = [field.number, kind, field.is_repeated]
    for nested in descriptor.nested_types:
        out |= {f"{nested.name}.{k}": v for k, v in _fields(nested).items()}
    return out


def test_every_message_and_field_is_numbered_as_tritonclients_own():
    names = list(pb.DESCRIPTOR.message_types_by_name)
    code = inspect.getsource(_fields) + (
        "import json, sys\n"
        "from tritonclient.grpc import service_pb2 as triton\n"
        "pool = triton.DESCRIPTOR\n"
        "messages = {n: _fields(pool.message_types_by_name[n]) for n in sys.argv[1:]}\n"
        "service = pool.services_by_name['GRPCInferenceService']\n"
        "methods = {m.name: [m.input_type.name, m.output_type.name] for m in service.methods}\n"
        "print(json.dumps({'messages': messages, 'methods': methods}))\n"
    )
    theirs = in_own_process(code, *names)
    assert names and {n: _fields(pb.DESCRIPTOR.message_types_by_name[n]) for n in names} == theirs["messages"]
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        assert theirs["methods"][method.name] == [method.input_type.name, method.output_type.name], method.name


def test_the_generated_stubs_are_what_the_proto_generates(tmp_path):
    generate.generate(tmp_path)
    for name in ("inference_pb2.py", "inference_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "contract/rpc" / name, generate.ROOT / "contract/rpc" / name, shallow=False), name


@pytest.fixture(scope="module", params=["colocated", "deployment"])
def app(request, serve_port, tiny_models_dir):
    """The tiny models with gRPC on a port of their own and small limits, once per placement."""
    grpc_port = free_port()
    settings = {"ingress": {"grpc_port": grpc_port}, "limits": {"max_body_bytes": MAX_BODY_BYTES}}
    with deployed(serve_port, f"grpc-{request.param}", tiny_models_dir, request.param, **settings) as served:
        yield served


@pytest.fixture
def stub(app):
    with grpc.insecure_channel(app.grpc_url) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _ids(seed: int, shape=(3, 6)) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 260, size=shape).astype(np.int64)  # (B, T)


TRITON_INFER = """
import json, sys
import numpy as np
import tritonclient.grpc as triton

url, name, ids, mask, texts = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
client = triton.InferenceServerClient(url=url)
out = {"live": client.is_server_live(), "ready": client.is_server_ready(), "model_ready": client.is_model_ready(name)}
out["extensions"] = list(client.get_server_metadata().extensions)
meta = client.get_model_metadata(name)
out["platform"], out["inputs"] = meta.platform, [i.name for i in meta.inputs]
inputs = [triton.InferInput(n, list(np.shape(v)), "INT64") for n, v in (("input_ids", ids), ("attention_mask", mask))]
inputs[0].set_data_from_numpy(np.array(ids, dtype=np.int64))  # the defaults: raw contents
inputs[1].set_data_from_numpy(np.array(mask, dtype=np.int64))
result = client.infer(name, inputs, request_id="g1")
out["id"], out["ids_logits"] = result.get_response().id, result.as_numpy("logits").tolist()
text = triton.InferInput("text", [len(texts)], "BYTES")
text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
answer = client.infer(name, [text], outputs=[triton.InferRequestedOutput("logits")])
out["text_logits"] = answer.as_numpy("logits").tolist()
client.close()
print(json.dumps(out))
"""


@pytest.mark.serve
def test_tritonclient_grpc_round_trips_ids_masks_and_text_like_ort(app):
    ids, mask = _ids(5, (4, 9)), np.ones((4, 9), dtype=np.int64)
    mask[1, 6:] = 0
    texts = ["a short one", "and a somewhat longer text"]
    args = [json.dumps(a) for a in (ids.tolist(), mask.tolist(), texts)]
    out = in_own_process(TRITON_INFER, app.grpc_url, NAME, *args)
    assert out["live"] and out["ready"] and out["model_ready"] and "binary_tensor_data" in out["extensions"]
    assert out["platform"] == "onnxruntime_onnx" and out["inputs"] == ["input_ids", "attention_mask"]
    assert out["id"] == "g1"
    np.testing.assert_allclose(out["ids_logits"], bare_logits(app.models_dir, NAME, ids, mask), atol=1e-6)
    want = bare_logits(app.models_dir, NAME, *ByteTokenizer(32).encode_batch(texts))
    np.testing.assert_allclose(out["text_logits"], want, atol=1e-6)


@pytest.mark.serve
def test_typed_contents_answer_like_raw_contents(app, stub):
    ids = _ids(6, (2, 5))
    message = pb.ModelInferRequest(model_name=NAME)
    tensor = message.inputs.add(name="input_ids", datatype="INT64", shape=[2, 5])
    tensor.contents.int64_contents.extend(ids.ravel().tolist())
    answer = stub.ModelInfer(message, timeout=30)
    logits = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(list(answer.outputs[0].shape))
    np.testing.assert_allclose(logits, bare_logits(app.models_dir, NAME, ids), atol=1e-6)


def _infer_error(stub, message: pb.ModelInferRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        stub.ModelInfer(message, timeout=30)
    return failed.value


def _raw(shape: list[int], data: bytes, name: str = "input_ids", datatype: str = "INT64", model: str = NAME):
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name=name, datatype=datatype, shape=shape)
    message.raw_input_contents.append(data)
    return message


@pytest.mark.serve
def test_errors_are_grpc_status_codes_naming_the_problem_and_the_server_keeps_serving(app, stub):
    ids = _ids(7, (1, 4)).tobytes()
    extra = _raw([1, 4], ids)
    extra.raw_input_contents.append(ids)
    hostile = {
        "unknown model": (_raw([1, 4], ids, model="mha-nope"), grpc.StatusCode.NOT_FOUND, "unknown model"),
        "truncated raw contents": (_raw([1, 4], ids[:20]), grpc.StatusCode.INVALID_ARGUMENT, "not a whole number"),
        "raw size against shape": (_raw([2, 4], ids), grpc.StatusCode.INVALID_ARGUMENT, "needs 8 values"),
        "raw entries against inputs": (extra, grpc.StatusCode.INVALID_ARGUMENT, "2 entries for 1 inputs"),
        "wrong datatype": (_raw([1, 1], b"\0" * 4, datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT, "FP32"),
        "no inputs": (pb.ModelInferRequest(model_name=NAME), grpc.StatusCode.INVALID_ARGUMENT, "no inputs"),
        "ids outside the vocabulary": (
            _raw([1, 1], np.array([[9999]], dtype="<i8").tobytes()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the vocabulary",
        ),
        "message over the body limit": (
            _raw([1, MAX_BODY_BYTES], b"\0" * 8 * MAX_BODY_BYTES),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
    }
    for case, (message, code, text) in hostile.items():
        error = _infer_error(stub, message)
        assert error.code() == code and text in error.details(), (case, error.code(), error.details())
    with pytest.raises(grpc.RpcError) as unknown:
        stub.ModelReady(pb.ModelReadyRequest(name=NAME, version="7"), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    answer = stub.ModelInfer(_raw([1, 4], ids), timeout=30)  # still serving
    assert list(answer.outputs[0].shape) == [1, 2]


@pytest.mark.serve
def test_grpc_requests_are_counted_under_their_own_endpoint(app, stub, metrics_port):
    import time

    import httpx

    stub.ModelInfer(_raw([1, 4], _ids(8, (1, 4)).tobytes()), timeout=30)
    wanted = ("ray_mha_requests_total{", 'endpoint="grpc_infer"', f'application="{app.name}"', f'model="{NAME}"')
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines()
        found = [line for line in lines if all(w in line for w in wanted)]
        if found:
            break
        time.sleep(1)
    assert found and 'code="200"' in " ".join(found) and 'precision="fp32"' in found[0]


@pytest.mark.serve
# The load tester measures the same whichever the placement: one.
@pytest.mark.parametrize("app", ["colocated"], indirect=True)
def test_the_load_tester_measures_a_model_over_grpc(app, tmp_path):
    command = [sys.executable, "-m", "service.cli", "loadtest", "--quiet", "--url", app.base_url, "--protocol", "grpc"]
    command += ["--grpc-url", app.grpc_url, "--models", NAME, "--concurrency", "4", "--rate", "", "--duration", "1"]
    command += ["--warmup", "0", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["protocol"] == "grpc" and [r["model"] for r in report["levels"]] == [NAME]
    assert report["levels"][0]["ok"] > 0 and report["levels"][0]["errors"] == {}


@pytest.mark.serve
def test_a_grpc_load_test_names_a_refused_call_like_its_http_twin(app):
    import asyncio

    from loadtest.grpc_client import GrpcPool
    from loadtest.workload import GRPC_INFER, encode_body

    async def two() -> tuple:
        pool = GrpcPool(app.grpc_url, 30)
        try:
            good = await pool.post(GRPC_INFER, encode_body("grpc", ["a fine film"], NAME))
            bad = await pool.post(GRPC_INFER, encode_body("grpc", ["a fine film"], "mha-nope"))
        finally:
            await pool.aclose()
        return good, bad

    good, bad = asyncio.run(two())
    assert good.status == 200 and pb.ModelInferResponse.FromString(good.body).outputs[0].name == "logits"
    assert bad.status == 404 and "NOT_FOUND: unknown model 'mha-nope'" in json.loads(bad.body)["error"]


@pytest.mark.serve
def test_grpc_health_says_serving_when_ready_and_not_serving_while_draining_and_watch_is_unimplemented(app):
    from ray import serve

    with grpc.insecure_channel(app.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        named = health.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=30)
        assert named.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="other"), timeout=30)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as watch:
            next(health.Watch(health_pb2.HealthCheckRequest(), timeout=30))
        assert watch.value.code() == grpc.StatusCode.UNIMPLEMENTED and "poll Check" in watch.value.details()
        serve.get_app_handle(app.name).drain.remote().result(timeout_s=30)  # what SIGTERM starts (the app goes after)
        draining = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert draining.status == health_pb2.HealthCheckResponse.NOT_SERVING
