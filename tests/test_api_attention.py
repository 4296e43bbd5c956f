"""POST /v1/models/{name}/attention over real HTTP: weights equal ONNX Runtime's on model.attn.onnx, rows sum to 1,
one layer or all, and clear errors (no variant, layer out of range, text too long, unknown model)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from contract.tokenizer import ByteTokenizer

pytestmark = pytest.mark.serve
WITH_VARIANT = "mha-h4-d32"  # the shared fixture exports this one with model.attn.onnx, mha-h2-d32 without
TEXT = "which head looks where?"


def _bare_weights(models_dir, name: str, text: str) -> np.ndarray:
    session = ort.InferenceSession(str(models_dir / name / "model.attn.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([ByteTokenizer(32).encode(text)], dtype=np.int64)
    (weights,) = session.run(["attention_weights"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    return weights[0]  # (layers, h, T, T)


def test_attention_answers_every_layer_and_head_as_onnx_runtime_does(service):
    with service.client() as c:
        response = c.post(f"/v1/models/{WITH_VARIANT}/attention", json={"text": TEXT})
    assert response.status_code == 200, response.text
    out = response.json()
    weights = np.asarray(out["weights"], dtype=np.float32)
    assert out["model"] == WITH_VARIANT and out["heads"] == 4 and out["layers"] == [0]
    assert out["tokens"] == ByteTokenizer(32).tokens(TEXT)
    assert weights.shape == (1, 4, len(TEXT) + 1, len(TEXT) + 1)
    np.testing.assert_allclose(weights, _bare_weights(service.models_dir, WITH_VARIANT, TEXT), atol=1e-6)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)


def test_attention_for_one_layer_and_predict_still_answers(service):
    with service.client() as c:
        one = c.post(f"/v1/models/{WITH_VARIANT}/attention", json={"text": TEXT, "layer": 0})
        predict = c.post(f"/v1/models/{WITH_VARIANT}/predict", json={"text": TEXT})
    assert one.status_code == 200 and one.json()["layers"] == [0]
    assert predict.status_code == 200 and "attention" not in predict.json()


@pytest.mark.parametrize(
    ("name", "body", "status", "message"),
    [
        ("mha-h2-d32", {"text": TEXT}, 404, "has no attention variant"),
        (WITH_VARIANT, {"text": TEXT, "layer": 1}, 400, "layer 1 is out of range"),
        (WITH_VARIANT, {"text": TEXT, "layer": -1}, 400, "layer -1 is out of range"),
        (WITH_VARIANT, {"text": "x" * 40}, 400, "over the model's max_len=32"),
        (WITH_VARIANT, {"texts": [TEXT]}, 400, "invalid request"),
        ("mha-nope", {"text": TEXT}, 404, "unknown model 'mha-nope'"),
    ],
)
def test_attention_bad_requests_get_a_json_error(service, name, body, status, message):
    with service.client() as c:
        response = c.post(f"/v1/models/{name}/attention", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
