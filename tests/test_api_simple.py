"""The simple JSON API and the model list over real HTTP: predictions, head configuration, backend, OpenAPI page."""

from __future__ import annotations

import numpy as np
import pytest
from serving import bare_logits

from contract.tokenizer import ByteTokenizer

pytestmark = pytest.mark.serve
NAMES = ["mha-h2-d32", "mha-h4-d32"]


def _check_prediction(out: dict, expected_logits: np.ndarray) -> None:
    logits = np.asarray(out["logits"], dtype=np.float32)
    np.testing.assert_allclose(logits, expected_logits, atol=1e-5)
    probs = np.asarray(out["probabilities"])
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    assert (probs.argmax(axis=1) == logits.argmax(axis=1)).all()
    assert out["predicted"] == [out["labels"][i] for i in logits.argmax(axis=1)]


@pytest.mark.parametrize("name", NAMES)
def test_predict_one_text_answers_label_probabilities_and_head_configuration(service, name):
    with service.client() as c:
        out = c.post(f"/v1/models/{name}/predict", json={"text": "the heads are all here"}).json()
    ids, mask = ByteTokenizer(32).encode_batch(["the heads are all here"])
    _check_prediction(out, bare_logits(service.models_dir, name, ids, mask))
    heads = int(name.split("-h")[1].split("-")[0])
    assert out["model"] == name and out["backend"] == "cpu"
    assert out["config"] == {
        "heads": heads,
        "head_dim": 32 // heads,
        "d_model": 32,
        "layers": 1,
        "layer_heads": [heads],
        "precision": "fp32",
    }
    assert out["label"] == out["predicted"][0]


def test_predict_several_texts_pads_to_the_longest(service):
    texts = ["x", "a much longer text here", ""]
    with service.client() as c:
        out = c.post("/v1/models/mha-h2-d32/predict", json={"texts": texts}).json()
    ids, mask = ByteTokenizer(32).encode_batch(texts)
    _check_prediction(out, bare_logits(service.models_dir, "mha-h2-d32", ids, mask))
    assert "label" not in out and len(out["predicted"]) == 3


def test_predict_ragged_token_ids_without_a_mask(service):
    rows = [[1, 40, 41, 42, 43], [1, 50]]
    with service.client() as c:
        out = c.post("/v1/models/mha-h4-d32/predict", json={"input_ids": rows}).json()
    ids = [[1, 40, 41, 42, 43], [1, 50, 0, 0, 0]]
    mask = [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    _check_prediction(out, bare_logits(service.models_dir, "mha-h4-d32", ids, mask))


def test_predict_token_ids_with_an_explicit_mask(service):
    ids, mask = [[1, 9, 9, 0], [1, 8, 7, 6]], [[1, 1, 1, 0], [1, 1, 1, 1]]
    with service.client() as c:
        out = c.post("/v1/models/mha-h2-d32/predict", json={"input_ids": ids, "attention_mask": mask}).json()
    _check_prediction(out, bare_logits(service.models_dir, "mha-h2-d32", ids, mask))


def test_model_list_shows_every_model_with_head_configuration_backend_and_readiness(service):
    with service.client() as c:
        models = c.get("/v1/models").json()["models"]
    assert [m["name"] for m in models] == NAMES
    for m in models:
        assert m["ready"] is True and m["backend"] == "cpu" and m["backend_reason"]
        assert m["heads"] * m["head_dim"] == m["d_model"] == 32 and m["layers"] == 1
        assert m["labels"] == ["negative", "positive"] and m["max_len"] == 32


def test_openapi_page_and_schema_list_every_route(service):
    with service.client() as c:
        assert c.get("/docs").status_code == 200
        document = c.get("/openapi.json").json()
    paths = document["paths"]
    for route in ("/v2/health/live", "/v2/models/{name}/infer", "/v1/models/{name}/predict", "/v1/models"):
        assert route in paths
    infer_body = paths["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "inputs" in document["components"]["schemas"][infer_body["$ref"].split("/")[-1]]["properties"]
    name = paths["/v1/models/{name}/predict"]["post"]["parameters"][0]["schema"]
    assert name["enum"] == ["mha-h2-d32", "mha-h4-d32"]  # this server's models
