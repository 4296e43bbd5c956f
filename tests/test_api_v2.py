"""Open Inference Protocol v2 over real HTTP: health, metadata, readiness, infer; NVIDIA tritonclient unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from serving import bare_logits, v2_tensor

from contract.tokenizer import ByteTokenizer

pytestmark = pytest.mark.serve
NAMES = ["mha-h2-d32", "mha-h4-d32"]


def _ids(seed: int, shape=(3, 6)) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 260, size=shape)  # (B, T)


def test_server_is_live_and_ready_and_describes_itself(service):
    with service.client() as c:
        assert c.get("/v2/health/live").json() == {"live": True}
        ready = c.get("/v2/health/ready")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        meta = c.get("/v2").json()
        assert meta["name"] == "mha-serving" and meta["version"] and meta["extensions"] == ["binary_tensor_data"]


@pytest.mark.parametrize("name", NAMES)
def test_model_metadata_follows_the_protocol_and_carries_the_head_configuration(service, name):
    with service.client() as c:
        meta = c.get(f"/v2/models/{name}").json()
        assert c.get(f"/v2/models/{name}/versions/1").json() == meta
        ready = c.get(f"/v2/models/{name}/ready")
    assert ready.status_code == 200 and ready.json() == {"name": name, "ready": True}
    assert meta["name"] == name and meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [
        {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]},
    ]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 2]}]
    heads = int(name.split("-h")[1].split("-")[0])
    assert meta["parameters"]["heads"] == heads and meta["parameters"]["head_dim"] * heads == 32


@pytest.mark.parametrize("name", NAMES)
def test_infer_with_ids_and_mask_matches_bare_onnx_runtime(service, name):
    ids = _ids(1)
    mask = np.ones_like(ids)
    mask[1, 4:] = 0  # a padded row
    body = {"id": "req-7", "inputs": [v2_tensor("input_ids", ids), v2_tensor("attention_mask", mask)]}
    body["outputs"] = [{"name": "logits"}]
    with service.client() as c:
        out = c.post(f"/v2/models/{name}/infer", json=body).json()
    assert out["model_name"] == name and out["model_version"] == "1" and out["id"] == "req-7"
    (logits,) = out["outputs"]
    assert logits["name"] == "logits" and logits["datatype"] == "FP32" and logits["shape"] == [3, 2]
    got = np.asarray(logits["data"], dtype=np.float32).reshape(logits["shape"])  # flat row-major -> (B, C)
    np.testing.assert_allclose(got, bare_logits(service.models_dir, name, ids, mask), atol=1e-5)


def test_infer_accepts_nested_data_and_the_versioned_path(service):
    ids = _ids(2, (2, 5))
    tensor = {"name": "input_ids", "datatype": "INT64", "shape": [2, 5], "data": ids.tolist()}  # nested lists
    with service.client() as c:
        out = c.post("/v2/models/mha-h2-d32/versions/1/infer", json={"inputs": [tensor]}).json()
    assert "id" not in out
    got = np.asarray(out["outputs"][0]["data"], dtype=np.float32).reshape(2, 2)
    np.testing.assert_allclose(got, bare_logits(service.models_dir, "mha-h2-d32", ids), atol=1e-5)


def test_infer_with_text_bytes_tokenizes_like_training(service):
    texts = ["a short one", "and a somewhat longer text"]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]}
    with service.client() as c:
        out = c.post("/v2/models/mha-h4-d32/infer", json=body).json()
    ids, mask = ByteTokenizer(32).encode_batch(texts)
    got = np.asarray(out["outputs"][0]["data"], dtype=np.float32).reshape(2, 2)
    np.testing.assert_allclose(got, bare_logits(service.models_dir, "mha-h4-d32", ids, mask), atol=1e-5)


def test_tritonclient_http_json_mode_round_trip(service):
    tritonclient_http = pytest.importorskip("tritonclient.http")
    url = service.base_url.removeprefix("http://")
    client = tritonclient_http.InferenceServerClient(url=url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mha-h4-d32")
    meta = client.get_model_metadata("mha-h4-d32")
    assert meta["platform"] == "onnxruntime_onnx" and meta["outputs"][0]["name"] == "logits"
    ids = _ids(3, (4, 9))
    inputs = [tritonclient_http.InferInput("input_ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(ids.astype(np.int64), binary_data=False)
    outputs = [tritonclient_http.InferRequestedOutput("logits", binary_data=False)]
    result = client.infer("mha-h4-d32", inputs, outputs=outputs, request_id="t1")
    assert result.get_response()["id"] == "t1"
    np.testing.assert_allclose(result.as_numpy("logits"), bare_logits(service.models_dir, "mha-h4-d32", ids), atol=1e-5)
    client.close()
