"""Every wrong input gets a 4xx with a JSON error naming the problem; unknown model 404; not ready and over capacity
503; a broken model folder next to a good one fails alone, saying why."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import onnxruntime as ort
import pytest
from serving import v2_tensor

pytestmark = pytest.mark.serve
INFER = "/v2/models/mha-h2-d32/infer"
PREDICT = "/v1/models/mha-h2-d32/predict"
IDS = [[1, 5, 6, 7]]

BAD_V2 = {
    "wrong tensor name": ({"inputs": [v2_tensor("tokens", IDS)]}, "unexpected or repeated inputs ['tokens']"),
    "wrong datatype": ({"inputs": [v2_tensor("input_ids", IDS, "FP32")]}, "must have datatype INT64, got FP32"),
    "float data": ({"inputs": [v2_tensor("input_ids", [[1.5, 2.0]])]}, "data must be integers"),
    "rank 1 shape": ({"inputs": [v2_tensor("input_ids", [1, 5, 6])]}, "shape must be [batch, sequence]"),
    "shape and data disagree": (
        {"inputs": [v2_tensor("input_ids", IDS, shape=[2, 4])]},
        "shape [2, 4] needs 8 values, data has 4",
    ),
    "mask shape differs": (
        {"inputs": [v2_tensor("input_ids", IDS), v2_tensor("attention_mask", [[1, 1]])]},
        "attention_mask shape [1, 2] differs from input_ids [1, 4]",
    ),
    "mask not 0/1": (
        {"inputs": [v2_tensor("input_ids", IDS), v2_tensor("attention_mask", [[1, 2, 1, 1]])]},
        "only 0 (padding) and 1 (token)",
    ),
    "all-padding row": (
        {"inputs": [v2_tensor("input_ids", IDS), v2_tensor("attention_mask", [[0, 0, 0, 0]])]},
        "row 0 has no tokens",
    ),
    "empty input": ({"inputs": [v2_tensor("input_ids", [[]], shape=[1, 0])]}, "input_ids is empty"),
    "no inputs": ({"inputs": []}, "inputs: List should have at least 1 item"),
    "id outside the vocabulary": ({"inputs": [v2_tensor("input_ids", [[1, 260]])]}, "token id 260 is outside"),
    "negative id": ({"inputs": [v2_tensor("input_ids", [[1, -3]])]}, "token id -3 is outside"),
    "longer than max_len": (
        {"inputs": [v2_tensor("input_ids", [[5] * 33])]},
        "length 33 is over the model's max_len=32",
    ),
    "text too long": (
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x" * 40]}]},
        "over the model's max_len=32",
    ),
    "text shape mismatch": (
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
        "shape [2] does not match 1 strings",
    ),
    "unknown output": ({"inputs": [v2_tensor("input_ids", IDS)], "outputs": [{"name": "probs"}]}, "unknown output"),
}


@pytest.mark.parametrize("case", list(BAD_V2))
def test_bad_v2_request_is_a_400_naming_the_problem(service, case):
    body, expected = BAD_V2[case]
    with service.client() as c:
        r = c.post(INFER, json=body)
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]


BAD_SIMPLE = {
    "nothing to predict": ({}, "send exactly one of 'text', 'texts' or 'input_ids'"),
    "two inputs": ({"text": "a", "texts": ["b"]}, "send exactly one of"),
    "no texts": ({"texts": []}, "no texts given"),
    "unknown key": ({"txt": "a"}, "txt: Extra inputs are not permitted"),
    "empty id row": ({"input_ids": [[1, 2], []]}, "row 1 of input_ids is empty"),
    "ragged ids with a mask": ({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}, "not a rectangular"),
    "mask without ids": ({"text": "a", "attention_mask": [[1]]}, "'attention_mask' goes with 'input_ids'"),
}


@pytest.mark.parametrize("case", list(BAD_SIMPLE))
def test_bad_simple_request_is_a_400_naming_the_problem(service, case):
    body, expected = BAD_SIMPLE[case]
    with service.client() as c:
        r = c.post(PREDICT, json=body)
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]


@pytest.mark.parametrize("path", [INFER, PREDICT])
def test_malformed_json_is_a_400_whatever_the_content_type(service, path):
    with service.client() as c:
        r = c.post(path, content=b'{"inputs": [', headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["error"].startswith("malformed JSON body")


def test_body_over_one_mebibyte_is_a_413(service):
    with service.client() as c:
        r = c.post(PREDICT, json={"text": "x" * (1 << 20)})
    assert r.status_code == 413 and "over the limit of 1048576 bytes" in r.json()["error"]


def test_more_rows_than_the_configured_limit_is_a_400(limited_service):
    with limited_service.client() as c:
        r = c.post(PREDICT, json={"texts": ["a"] * 5})
    assert r.status_code == 400 and "5 texts in one request, over the limit of 4" in r.json()["error"]


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v2/models/mha-h3-d32"),
        ("GET", "/v2/models/mha-h3-d32/ready"),
        ("POST", "/v2/models/mha-h3-d32/infer"),
        ("POST", "/v1/models/mha-h3-d32/predict"),
        ("GET", "/v2/models/mha-h2-d32/versions/2"),
    ],
)
def test_unknown_model_or_version_is_a_404(service, method, path):
    with service.client() as c:
        r = c.request(method, path, json={"text": "a"} if method == "POST" else None)
    assert r.status_code == 404 and ("unknown model 'mha-h3-d32'" in r.json()["error"] or "no version" in r.text)


def test_unknown_route_is_a_json_404(service):
    with service.client() as c:
        r = c.get("/v3/nothing")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}


BROKEN = {
    "mha-missing": "model.onnx is missing",
    "mha-corrupt": "ONNX Runtime cannot load",
    "mha-h9-d32": "metadata name is 'mha-h2-d32'",
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_model_folder_is_not_ready_and_says_why(limited_service, name):
    with limited_service.client() as c:
        ready = c.get(f"/v2/models/{name}/ready")
        infer = c.post(f"/v2/models/{name}/infer", json={"inputs": [v2_tensor("input_ids", IDS)]})
    assert ready.status_code == 503 and BROKEN[name] in ready.json()["error"]
    assert infer.status_code == 503 and BROKEN[name] in infer.json()["error"]


def test_broken_folders_do_not_stop_the_good_model_and_the_list_says_which_is_which(limited_service):
    with limited_service.client() as c:
        models = {m["name"]: m for m in c.get("/v1/models").json()["models"]}
        server_ready = c.get("/v2/health/ready")
        good = c.post(PREDICT, json={"text": "still serving"})
    assert models["mha-h2-d32"]["ready"] is True and models["mha-h2-d32"]["backend"] == "cpu"
    for name, why in BROKEN.items():
        assert models[name]["ready"] is False and why in models[name]["error"]
    assert server_ready.status_code == 503 and "mha-corrupt" in server_ready.json()["error"]
    assert good.status_code == 200 and good.json()["model"] == "mha-h2-d32"


def test_a_burst_over_capacity_gets_quick_503s_and_the_replica_keeps_serving(limited_service):
    """max_ongoing_requests=1, max_queued_requests=1, a 0.5 s batch window: most of a 12-request burst is refused."""

    def call(_):
        start = time.perf_counter()
        with limited_service.client() as c:
            r = c.post(PREDICT, json={"text": "burst"})
        return r.status_code, r.json(), time.perf_counter() - start

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, range(12)))
    refused = [(body, s) for code, body, s in results if code == 503]
    served = [body for code, body, _ in results if code == 200]
    assert len(refused) + len(served) == 12 and served and refused
    assert all("over capacity" in body["error"] for body, _ in refused)
    with limited_service.client() as c:
        assert c.post(PREDICT, json={"text": "after the burst"}).status_code == 200


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="onnxruntime-gpu is installed here"
)
def test_backend_gpu_without_one_fails_the_application_at_start_saying_why(serve_port, tiny_models_dir):
    from ray import serve

    from service.app import build_app, failure_reasons

    config = {"models_dir": str(tiny_models_dir), "models": ["mha-h2-d32"], "backend": "gpu"}
    config["deployment"] = {"num_cpus": 0.1}
    try:
        with pytest.raises(RuntimeError, match=r"Deploying application gpu failed"):
            serve.run(build_app(config), name="gpu", route_prefix="/gpu", blocking=False)
        reason = failure_reasons("gpu")["mha-h2-d32"]
        assert "BackendError" in reason and "CPU-only package" in reason
    finally:
        serve.delete("gpu")


def test_a_corrupt_attention_variant_is_a_503_that_says_why_without_server_paths(limited_service):
    with limited_service.client() as c:
        r = c.post("/v1/models/mha-h2-d32/attention", json={"text": "look"})
        still = c.post(PREDICT, json={"text": "the model itself still serves"})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert "attention variant of model 'mha-h2-d32' cannot be used" in error and "model.attn.onnx" in error
    assert str(limited_service.models_dir) not in error and "/tmp" not in error
    assert still.status_code == 200


def _raw_post(base_url: str, path: str, head_extra: str, first: bytes) -> socket.socket:
    """A POST whose headers and first body bytes are sent, the rest withheld."""
    url = httpx.URL(base_url)
    sock = socket.create_connection((url.host, url.port), timeout=10)
    head = f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    sock.sendall((head + head_extra + "\r\n").encode() + first)
    return sock


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_frees_its_slot(limited_service):
    """limits.body_timeout_s is 1 s here: the client sends 1 byte of 200 and stalls."""
    sock = _raw_post(limited_service.base_url, PREDICT, "Content-Length: 200\r\n", b"{")
    start = time.perf_counter()
    chunks = []
    try:
        while chunk := sock.recv(65536):  # the server closes the connection after a 408
            chunks.append(chunk)
    finally:
        sock.close()
    answer = b"".join(chunks).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "did not arrive within 1 s" in answer and time.perf_counter() - start < 5
    with limited_service.client() as c:
        assert c.post(PREDICT, json={"text": "next client"}).status_code == 200


def test_more_inference_requests_than_max_in_flight_get_a_quick_json_503_with_retry_after(serve_port, tiny_models_dir):
    """limits.max_in_flight 2, a 1 s batch window: of 8 concurrent requests, those past 2 are refused at once."""
    from ray import serve
    from serving import deploy

    settings = {"batch_wait_timeout_s": 1.0, "max_batch_size": 64}
    served = deploy(
        serve_port, "inflight", tiny_models_dir, models=["mha-h2-d32"], deployment=settings, limits={"max_in_flight": 2}
    )
    try:
        with served.client() as c:
            assert c.post(PREDICT, json={"text": "warm"}).status_code == 200

        def call(_):
            with served.client() as c:
                start = time.perf_counter()
                r = c.post(PREDICT, json={"text": "flood"})
                return r, time.perf_counter() - start

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(8)))
        refused = [(r, s) for r, s in results if r.status_code == 503]
        assert refused and len(refused) + sum(r.status_code == 200 for r, _ in results) == 8
        for r, seconds in refused:
            assert "over capacity" in r.json()["error"] and r.headers["retry-after"] == "1"
            assert seconds < settings["batch_wait_timeout_s"] / 2, seconds  # not held as the admitted are
    finally:
        serve.delete("inflight")


@pytest.mark.parametrize(
    "method,path,allow",
    [("POST", "/v2/health/live", "GET"), ("GET", PREDICT, "POST"), ("DELETE", "/v1/models", "GET")],
)
def test_a_wrong_method_is_a_json_405_that_keeps_its_allow_header(service, method, path, allow):
    with service.client() as c:
        r = c.request(method, path)
    assert r.status_code == 405 and r.json() == {"error": "Method Not Allowed"}
    assert r.headers["allow"] == allow


def test_booleans_are_not_token_ids(service):
    with service.client() as c:
        simple = c.post(PREDICT, json={"input_ids": [[True, False]]})
        v2 = c.post(INFER, json={"inputs": [v2_tensor("input_ids", [[True, False]], "INT64")]})
    assert simple.status_code == 400 and "input_ids.0.0: Input should be a valid integer" in simple.json()["error"]
    assert v2.status_code == 400 and "data must be integers, got bool values" in v2.json()["error"]


@pytest.mark.parametrize("big", [2**63, 2**64 + 5, -(2**63) - 1])
def test_an_id_past_int64_is_reported_as_sent_not_wrapped(service, big):
    with service.client() as c:
        simple = c.post(PREDICT, json={"input_ids": [[1, big]]})
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, big]}  # ints as sent
        v2 = c.post(INFER, json={"inputs": [tensor]})
    for r in (simple, v2):
        assert r.status_code == 400 and f"input_ids: {big} is outside the int64 range" in r.json()["error"], r.text


def test_a_long_model_name_is_not_echoed_whole(service):
    name = "m" * 10_000
    with service.client() as c:
        r = c.post(f"/v1/models/{name}/predict", json={"text": "a"})
    error = r.json()["error"]
    assert r.status_code == 404 and f"unknown model '{'m' * 80}...'" in error and len(error) < 300


def test_not_ready_reasons_name_the_model_folder_never_a_server_path(limited_service):
    with limited_service.client() as c:
        errors = [m.get("error", "") for m in c.get("/v1/models").json()["models"]]
        errors += [c.get(f"/v2/models/{name}/ready").json()["error"] for name in BROKEN]
    root = str(limited_service.models_dir)
    assert "model 'mha-missing': mha-missing/model.onnx is missing" in errors
    assert any("ONNX Runtime cannot load mha-corrupt/model.onnx" in e for e in errors), errors
    assert not any(root in e or "/tmp/" in e for e in errors), errors


def test_expect_100_continue_over_the_body_limit_gets_413_before_any_100_continue(service):
    """Through Serve's proxy (as on a cluster), which keeps the default 1 MiB body limit."""
    sock = _raw_post(service.base_url, PREDICT, "Content-Length: 2000000\r\nExpect: 100-continue\r\n", b"")
    with sock:
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # the server closes after a refusal
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer, answer[:200]
    assert b"over the limit of 1048576 bytes" in answer
