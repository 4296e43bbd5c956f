"""The Open Inference Protocol's binary tensor data extension: tritonclient.http with its defaults (binary in and
out) for ids, masks and text, mixed JSON and binary inputs, and every malformed body a 400 naming the problem."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from serving import bare_logits

from contract.tokenizer import ByteTokenizer
from service.errors import BadRequestError
from service.protocol import binary
from service.protocol.v2 import InferRequest

NAME = "mha-h4-d32"


def _ids(seed: int, shape=(3, 6)) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 260, size=shape).astype(np.int64)  # (B, T)


def _strings(*texts: bytes) -> bytes:
    return b"".join(len(t).to_bytes(4, "little") + t for t in texts)


def _body(inputs: list[dict], blob: bytes, **extra) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + blob, {"Inference-Header-Content-Length": str(len(header))}


def _ids_input(shape: list[int], size: int, datatype: str = "INT64", **more) -> dict:
    return {"name": "input_ids", "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": size}, **more}


def _parsed(raw: bytes, headers: dict[str, str]) -> InferRequest:
    header, blob = binary.split(raw, headers.get("Inference-Header-Content-Length"))
    request = InferRequest.model_validate_json(header)
    binary.attach(request, blob)
    return request


def _text_input(shape: list[int], size: int) -> dict:
    return {"name": "text", "datatype": "BYTES", "shape": shape, "parameters": {"binary_data_size": size}}


IDS = _ids(1, (2, 3)).tobytes()  # 48 bytes: 2 x 3 int64
GOOD = _body([_ids_input([2, 3], 48)], IDS)[0]
LENGTH = "Inference-Header-Content-Length"
MALFORMED = {  # case -> (body, headers, what the 400 says)
    "header length is not a number": (GOOD, {LENGTH: "4x"}, "must be a byte count"),
    "header length past the body": (GOOD, {LENGTH: "100000"}, "past the end of the"),
    "sizes add up to more than the body": (*_body([_ids_input([2, 3], 56)], IDS), "add up to more than the 48 bytes"),
    "bytes left over": (*_body([_ids_input([1, 5], 40)], IDS), "8 bytes after the JSON header belong to no input"),
    "size not a multiple of the datatype": (
        *_body([_ids_input([2, 3], 47)], IDS[:47]),
        "47 bytes are not a whole number of INT64 values",
    ),
    "shape does not match": (
        *_body([_ids_input([3, 3], 48)], IDS),
        "shape [3, 3] needs 9 values, its binary data holds 6",
    ),
    "negative size": (*_body([_ids_input([2, 3], -1)], IDS), "binary_data_size must be a byte count"),
    "size given as true": (*_body([_ids_input([2, 3], True)], IDS), "binary_data_size must be a byte count"),
    "size without the header": (
        json.dumps({"inputs": [_ids_input([2, 3], 48)]}).encode(),
        {},
        "has no Inference-Header-Content-Length header",
    ),
    "data and binary data both": (
        *_body([_ids_input([2, 3], 48, data=[1] * 6)], IDS),
        "has both 'data' and binary_data_size",
    ),
    "a datatype the models do not take": (
        *_body([_ids_input([2, 3], 24, datatype="FP32")], IDS[:24]),
        "datatype FP32 is not INT64 or BYTES",
    ),
    "BYTES length cut off": (*_body([_text_input([1], 2)], b"\x05\x00"), "length of BYTES element 0 is cut off"),
    "BYTES element past its data": (
        *_body([_text_input([1], 6)], b"\x09\x00\x00\x00hi"),
        "BYTES element 0 of 9 bytes runs past its data",
    ),
    "BYTES not UTF-8": (*_body([_text_input([1], 6)], _strings(b"\xff\xfe")), "BYTES element 0 is not UTF-8 text"),
    "more BYTES elements than the shape": (
        *_body([_text_input([1], 10)], _strings(b"a", b"b")),
        "more than the 1 BYTES elements",
    ),
    "fewer BYTES elements than the shape": (
        *_body([_text_input([3], 10)], _strings(b"a", b"b")),
        "shape needs 3 BYTES elements, its binary data holds 2",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_binary_body_is_refused_naming_the_problem(case):
    raw, headers, message = MALFORMED[case]
    with pytest.raises(BadRequestError, match=re.escape(message)):
        _parsed(raw, headers)


def test_a_header_length_of_0_means_the_whole_body_is_json_as_triton_reads_it():
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}).encode()
    assert _parsed(body, {LENGTH: "0"}) == _parsed(body, {})
    sized = json.dumps({"inputs": [_ids_input([1, 1], 8)]}).encode()
    with pytest.raises(BadRequestError, match="or 0: the body is all JSON"):
        _parsed(sized, {LENGTH: "0"})


def test_binary_and_json_inputs_mix_and_decode_to_the_same_tensors():
    ids, mask = _ids(2), np.ones((3, 6), dtype=np.int64)
    mask[1, 4:] = 0
    inputs = [_ids_input([3, 6], ids.nbytes), {"name": "attention_mask", "datatype": "INT64", "shape": [3, 6]}]
    inputs[1]["data"] = mask.ravel().tolist()  # JSON beside binary
    request = _parsed(*_body(inputs, ids.tobytes()))
    np.testing.assert_array_equal(request.inputs[0].data.reshape(3, 6), ids)
    blob = _strings("héllo".encode(), b"hi")
    text = _parsed(*_body([_text_input([2], len(blob))], blob))
    assert text.inputs[0].data == ["héllo", "hi"]


def test_outputs_are_binary_when_asked_per_output_or_for_all():
    def request(**fields) -> InferRequest:
        return InferRequest.model_validate({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}], **fields})

    assert binary.wants_binary(request()) is False
    assert binary.wants_binary(request(parameters={"binary_data_output": True})) is True
    own_setting = [{"name": "logits", "parameters": {"binary_data": False}}]
    own = request(parameters={"binary_data_output": True}, outputs=own_setting)
    assert binary.wants_binary(own) is False  # the output's own setting wins
    with pytest.raises(BadRequestError, match="'binary_data' must be true or false"):
        binary.wants_binary(request(outputs=[{"name": "logits", "parameters": {"binary_data": "yes"}}]))
    with pytest.raises(BadRequestError, match="classification extension is not supported"):
        binary.wants_binary(request(outputs=[{"name": "logits", "parameters": {"classification": 1}}]))


@pytest.mark.serve
def test_tritonclient_http_defaults_binary_in_and_out_round_trip_ids_masks_and_text(service):
    tritonclient_http = pytest.importorskip("tritonclient.http")
    client = tritonclient_http.InferenceServerClient(url=service.base_url.removeprefix("http://"))
    ids, mask = _ids(3, (4, 9)), np.ones((4, 9), dtype=np.int64)
    mask[2, 5:] = 0
    inputs = [tritonclient_http.InferInput(n, [4, 9], "INT64") for n in ("input_ids", "attention_mask")]
    inputs[0].set_data_from_numpy(ids)  # the defaults: binary data
    inputs[1].set_data_from_numpy(mask)
    result = client.infer(NAME, inputs, request_id="b1")  # no outputs named: binary_data_output for all
    want = bare_logits(service.models_dir, NAME, ids, mask)
    assert result.get_response()["id"] == "b1"
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == want.nbytes
    np.testing.assert_allclose(result.as_numpy("logits"), want, atol=1e-6)
    texts = ["a short one", "and a somewhat longer text"]
    text = tritonclient_http.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    out = client.infer(NAME, [text], outputs=[tritonclient_http.InferRequestedOutput("logits")])
    ids2, mask2 = ByteTokenizer(32).encode_batch(texts)
    np.testing.assert_allclose(out.as_numpy("logits"), bare_logits(service.models_dir, NAME, ids2, mask2), atol=1e-6)
    client.close()


@pytest.mark.serve
def test_malformed_binary_bodies_get_a_400_and_the_server_keeps_serving(service):
    with service.client() as c:
        for case, (raw, headers, message) in MALFORMED.items():
            response = c.post(f"/v2/models/{NAME}/infer", content=raw, headers=headers)
            assert response.status_code == 400 and message in response.json()["error"], case
        twice = [(LENGTH, "21"), (LENGTH, "22")]  # which one splits the body? neither: refused
        response = c.post(f"/v2/models/{NAME}/infer", content=GOOD, headers=twice)
        assert response.status_code == 400 and f"{LENGTH} given 2 times" in response.json()["error"]
        as_json = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
        zero = c.post(f"/v2/models/{NAME}/infer", json=as_json, headers={LENGTH: "0"})  # 0: the body is all JSON
        assert zero.status_code == 200 and zero.json() == c.post(f"/v2/models/{NAME}/infer", json=as_json).json()
        predict = c.post(f"/v1/models/{NAME}/predict", content=b"{}", headers={"Inference-Header-Content-Length": "2"})
        assert predict.status_code == 400 and "is for POST /v2/models/{name}/infer" in predict.json()["error"]
        ids = _ids(4, (1, 5))
        raw, headers = _body([_ids_input([1, 5], 40)], ids.tobytes())
        good = c.post(f"/v2/models/{NAME}/infer", content=raw, headers=headers)
        assert good.status_code == 200 and good.headers["content-type"] == "application/json"
        want = bare_logits(service.models_dir, NAME, ids)[0]
        np.testing.assert_allclose(good.json()["outputs"][0]["data"], want, atol=1e-6)
