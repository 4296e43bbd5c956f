"""The OpenAPI document (built in-process, as the ingress serves it, the model repository API on): every $ref
resolves, every status the service answers is documented with the one error body, answers have schemas, no 422; the
request bodies' schemas state the served models' limits (tightest across models) and what the service refuses, the
repository's bodies included; the binary tensor data extension is described. Schemathesis runs over the served
document in test_reliability.py."""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import pytest
from serving import refs, resolved

from contract.metadata import ModelMetadata
from service.config import RequestLimits
from service.http.api import create_app
from service.http.api import document as build_document
from service.http.repository import TOKEN_SCHEME
from service.protocol import binary
from service.repository_settings import RepositorySettings
from service.route_config import ROUTE_NAME
from service.validation import Bounds

ERROR = {"$ref": "#/components/schemas/ErrorBody"}
OPENAI_ERROR = {"$ref": "#/components/schemas/OpenAIErrorBody"}
LIMITS = RequestLimits(max_rows=3)
# Two models with different limits: the document states the tighter of each (SMALL's max_len, WIDE's vocabulary)
SMALL = ModelMetadata("mha-h2-d32", 2, 16, 32, layers=3, vocab_size=300, max_len=6, num_classes=2, labels=("a", "b"))
WIDE = ModelMetadata("mha-h4-d32", 4, 8, 32, layers=2, vocab_size=100, max_len=64, num_classes=2, labels=("a", "b"))
TIGHTEST = {"max_len": SMALL.max_len, "vocab_size": WIDE.vocab_size, "layers": WIDE.layers}


ROUTE = "pair"
REPOSITORY = {"POST /v2/repository/index"} | {f"POST /v2/repository/models/{{model}}/{a}" for a in ("load", "unload")}
REPOSITORY |= {"PUT /v2/repository/routes/{route}", "DELETE /v2/repository/routes/{route}"}


@pytest.fixture(scope="module")
def document() -> dict:
    """The document of the one application over SMALL and WIDE, and a route, with the model repository API turned
    on: its routes, the names served and the models' limits."""
    names = [SMALL.name, WIDE.name]
    plane = SimpleNamespace(limits=LIMITS, model_names=names, metrics=None, models_dir="models")
    repository = SimpleNamespace(enabled=True, header=RepositorySettings().header)  # reached only by requests
    app = create_app(plane, repository)
    return build_document(app, names, Bounds.of(LIMITS.max_rows, [SMALL, WIDE]), [ROUTE])


def valid(document: dict, component: str, body) -> bool:
    """Whether `body` is valid by the document's component schema (its $refs resolved within the document)."""
    schema = {**document["components"]["schemas"][component], "components": document["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def operations(document: dict):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield f"{method.upper()} {path}", operation


def test_every_ref_resolves(document):
    found = set(refs(document))
    assert "#/components/schemas/IdsInput" in found and "#/components/schemas/PredictRequest" in found
    assert {"#/components/schemas/RepositoryIndexRequest", "#/components/schemas/Route"} <= found
    for ref in found:
        assert resolved(document, ref) is not None, f"{ref} does not resolve"


def test_every_status_the_service_answers_is_documented_with_the_error_body_and_none_it_does_not(document):
    for name, operation in operations(document):
        statuses = set(operation["responses"])
        expected = {"200", "405", "413", "431"}
        if name in REPOSITORY:  # administrative: no model answers, every body read within the limits
            expected |= {"400", "401", "408"}
        elif name.startswith("POST"):
            expected |= {"400", "404", "408", "503"}
        assert expected <= statuses and "422" not in statuses, (name, sorted(statuses))
        for status, response in operation["responses"].items():
            schema = response["content"]["application/json"]["schema"]
            error = OPENAI_ERROR if " /openai/" in name else ERROR  # OpenAI's error shape under its prefix
            assert schema == error if status != "200" else schema["$ref"] != error["$ref"], (name, status)
        assert operation["responses"]["405"]["headers"]["Allow"]["required"] is True
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and schemas["ErrorBody"]["required"] == ["error"]


def test_answers_have_schemas_with_their_fields(document):
    schemas = document["components"]["schemas"]
    for name, operation in operations(document):
        answer = resolved(document, operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"])
        if answer.get("type") == "array":  # a list of objects (the repository's index)
            answer = resolved(document, answer["items"]["$ref"])
        assert answer["properties"] or answer["additionalProperties"] is False, name  # or exactly `{}`
    assert {"logits", "probabilities", "predicted", "config"} <= set(schemas["PredictResponse"]["required"])


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"text": "a"}, True),
        ({"texts": ["a", "b"]}, True),
        ({"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}, True),
        ({"text": None, "texts": ["a"]}, True),  # null counts as not sent, as in the service
        ({}, False),
        ({"text": "a", "texts": ["b"]}, False),
        ({"text": "a", "input_ids": [[1]]}, False),
        ({"text": "a", "attention_mask": [[1]]}, False),  # a mask goes with input_ids only
        ({"input_ids": [[True]]}, False),
        ({"texts": []}, False),
        ({"txt": "a"}, False),
        ({"input_ids": [[1]], "texts": [None]}, False),  # another key, given: not only the one
    ],
)
def test_the_predict_body_schema_says_exactly_one_of_text_texts_input_ids(document, body, expected):
    assert valid(document, "PredictRequest", body) is expected


def test_path_parameters_list_this_servers_values_when_known(document):
    for name, operation in operations(document):
        for param in operation.get("parameters", []):
            if param["in"] != "path":
                continue
            assert param["schema"]["type"] == "string", (name, param)
            if param["name"] == "name":  # what a request may name: the models, then the routes
                assert param["schema"]["enum"] == [SMALL.name, WIDE.name, ROUTE]
            if param["name"] == "model":  # what the repository loads and unloads: models
                assert param["schema"]["enum"] == [SMALL.name, WIDE.name]
            if param["name"] == "route":  # any name a route may have (a new one, set by PUT)
                assert "enum" not in param["schema"] and param["schema"]["pattern"] == ROUTE_NAME
            if param["name"] == "version":
                assert param["schema"]["enum"] == ["1"]


def text_input(**fields) -> dict:
    return {"inputs": [{"name": "text", "datatype": "BYTES", **fields}]}


def ids_input(ids: list[list[int]], mask: list[list[int]] | None = None) -> dict:
    """A v2 body of [B, T] ids (and mask), flat row-major."""
    tensors = [("input_ids", ids)] + ([("attention_mask", mask)] if mask is not None else [])
    flat = {name: [v for row in m for v in row] for name, m in tensors}  # (B, T) -> B * T, row-major
    shaped = [{"name": n, "datatype": "INT64", "shape": [len(m), len(m[0])], "data": flat[n]} for n, m in tensors]
    return {"inputs": shaped}


@pytest.mark.parametrize(
    "body,expected",
    [
        (text_input(shape=[]), False),  # the known hole: no data (and no shape) is not a request
        (text_input(shape=[1]), False),
        (text_input(shape=[1], data=["a"]), True),
        (text_input(shape=[1], data="a"), True),  # one string for one text, as the service takes it
        (text_input(shape=[1], data=["a"], parameters={"binary_data_size": 5}), False),  # no binary part in JSON
        (ids_input([[5, 6]], [[1, 0]]), True),
        (ids_input([[5, 6]], [[1, 1, 1]]), True),  # a mask's length against its ids': left to the service's 400
        ({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [[]]}]}, False),
        ({"inputs": [{"name": "attention_mask", "datatype": "INT64", "shape": [1, 1], "data": [1]}]}, False),
        ({"inputs": ids_input([[5]])["inputs"] * 2}, False),  # repeated
        (ids_input([[5]]) | {"outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}, True),
        (ids_input([[5]]) | {"outputs": [{"name": "probabilities"}]}, False),
        (ids_input([[5]]) | {"parameters": {"binary_data_output": "yes"}}, False),
    ],
)
def test_the_infer_body_schema_says_what_the_service_takes(document, body, expected):
    assert valid(document, "InferRequest", body) is expected


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"input_ids": [[5, 6]], "attention_mask": [[]]}, False),  # the known hole: an empty mask row
        ({"input_ids": [[5, 6]], "attention_mask": [[0, 0]]}, False),  # a row without a token
        ({"input_ids": [[5, 6]], "attention_mask": [[1, 0]]}, True),
        ({"input_ids": [[5, 6], [7]]}, True),  # rows of different lengths, padded by the service
        ({"input_ids": [[]]}, False),
    ],
)
def test_the_predict_body_schema_refuses_empty_and_tokenless_mask_rows(document, body, expected):
    assert valid(document, "PredictRequest", body) is expected


def test_the_bodies_state_the_tightest_limits_of_the_served_models(document):
    rows, length, vocab = LIMITS.max_rows, TIGHTEST["max_len"], TIGHTEST["vocab_size"]
    edge = [[vocab - 1] * length] * rows
    assert valid(document, "InferRequest", ids_input(edge)) and valid(document, "PredictRequest", {"input_ids": edge})
    for past in ([[vocab] * length], [[vocab - 1] * (length + 1)], [[1]] * (rows + 1)):
        assert not valid(document, "InferRequest", ids_input(past)), past
        assert not valid(document, "PredictRequest", {"input_ids": past}), past
    text = "a" * (length - 1)  # and a BOS
    assert valid(document, "PredictRequest", {"text": text}) and not valid(
        document, "PredictRequest", {"text": text + "a"}
    )
    assert valid(document, "InferRequest", text_input(shape=[1], data=[text]))
    assert not valid(document, "InferRequest", text_input(shape=[1], data=[text + "a"]))
    layers = TIGHTEST["layers"]
    assert valid(document, "AttentionRequest", {"text": "a", "layer": layers - 1})
    assert not valid(document, "AttentionRequest", {"text": "a", "layer": layers})


def test_a_model_that_takes_no_text_leaves_text_out_of_every_body():
    ids_only = ModelMetadata("ids-model", 2, 16, 32, 1, 260, 8, 2, ("a", "b"), tokenizer="ids")
    app = create_app(SimpleNamespace(limits=LIMITS, model_names=[ids_only.name], models_dir="models"))
    doc = build_document(app, [ids_only.name], Bounds.of(LIMITS.max_rows, [ids_only]))
    assert not valid(doc, "InferRequest", text_input(shape=[1], data=["a"])) and "TextInput" not in doc["components"]
    assert not valid(doc, "PredictRequest", {"text": "a"}) and not valid(doc, "PredictRequest", {"texts": ["a"]})
    assert valid(doc, "PredictRequest", {"input_ids": [[5]]}) and not valid(doc, "AttentionRequest", {"text": "a"})


def test_the_binary_tensor_data_extension_is_described_on_v2_infer(document):
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        operation = document["paths"][path]["post"]
        (header,) = [p for p in operation["parameters"] if p["in"] == "header"]
        assert header["name"] == binary.HEADER_NAME and header["required"] is False
        assert set(operation["requestBody"]["content"]) == {"application/json", "application/octet-stream"}
        answer = operation["responses"]["200"]
        assert set(answer["content"]) == {"application/json", "application/octet-stream"}
        assert binary.HEADER_NAME in answer["headers"]
    # the binary request's JSON header: each input gives its data or says binary_data_size, never neither or both
    sized = {"name": "text", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 5}}
    assert valid(document, "InferRequestHeader", {"inputs": [sized]})
    assert not valid(document, "InferRequestHeader", {"inputs": [sized | {"data": ["a"]}]})
    assert not valid(document, "InferRequestHeader", text_input(shape=[1]))
    assert valid(document, "InferRequestHeader", text_input(shape=[1], data=["a"]))


def test_the_repository_operations_and_only_they_ask_for_the_token(document):
    scheme = document["components"]["securitySchemes"][TOKEN_SCHEME]
    assert scheme == scheme | {"type": "apiKey", "in": "header", "name": RepositorySettings().header}
    for name, operation in operations(document):
        assert operation.get("security") == ([{TOKEN_SCHEME: []}] if name in REPOSITORY else None), name


@pytest.mark.parametrize(
    "component,body,expected",
    [
        ("RepositoryIndexRequest", {}, True),
        ("RepositoryIndexRequest", {"ready": True}, True),
        ("RepositoryIndexRequest", {"ready": 1}, False),
        ("RepositoryIndexRequest", [], False),
        ("RepositoryLoadRequest", {"parameters": {"unload_dependents": False, "n": 5, "s": "x"}}, True),
        ("RepositoryLoadRequest", {"parameters": None}, True),
        ("RepositoryLoadRequest", {"parameters": [1]}, False),
        ("RepositoryLoadRequest", {"parameters": 5}, False),
        ("RepositoryLoadRequest", {"parameters": {"config": "{}"}}, False),  # Triton's overrides: refused
        ("RepositoryLoadRequest", {"parameters": {"file:1/model.onnx": "AAAA"}}, False),
        ("RepositoryLoadRequest", {"parameters": {"a": {"b": 1}}}, False),
        ("RepositoryUnloadRequest", {"parameters": {"unload_dependents": True}}, True),
        ("RepositoryUnloadRequest", "x", False),
        ("Route", {"targets": {SMALL.name: 90, WIDE.name: 10}, "shadow": {"model": WIDE.name, "fraction": 0.5}}, True),
        ("Route", {"targets": {}}, False),
        ("Route", {"targets": {SMALL.name: 0, WIDE.name: 1}}, True),
        ("Route", {"targets": {SMALL.name: -1}}, False),
        ("Route", {"targets": {SMALL.name: True}}, False),
        ("Route", {"targets": {"not-served": 1}}, False),  # a route names served models only
        ("Route", {"targets": {SMALL.name: 1}, "shadow": {"model": WIDE.name, "fraction": 2}}, False),
        ("Route", {"targets": {SMALL.name: 1}, "extra": 1}, False),
    ],
)
def test_the_repository_body_schemas_say_what_the_service_takes(document, component, body, expected):
    assert valid(document, component, body) is expected


@pytest.mark.serve
def test_the_served_document_and_the_service_agree_at_the_models_limits(service):
    """Through the real app: a body at the served models' max_len and last token id is valid by the document and
    answered 200, one past either is invalid and answered 400; the two known holes are invalid and answered 400."""
    name = "mha-h2-d32"
    with service.client() as c:
        doc = c.get("/openapi.json").json()
        models = c.get("/v1/models").json()["models"]
        length, vocab = min(m["max_len"] for m in models), min(m["vocab_size"] for m in models)
        bodies = [
            ("InferRequest", ids_input([[vocab - 1] * length]), 200),
            ("InferRequest", ids_input([[vocab] * length]), 400),
            ("InferRequest", ids_input([[1] * (length + 1)]), 400),
            ("InferRequest", text_input(shape=[]), 400),
            ("PredictRequest", {"input_ids": [[vocab - 1] * length]}, 200),
            ("PredictRequest", {"input_ids": [[1] * (length + 1)]}, 400),
            ("PredictRequest", {"input_ids": [[5, 6]], "attention_mask": [[]]}, 400),
        ]
        for component, body, status in bodies:
            path = f"/v2/models/{name}/infer" if component == "InferRequest" else f"/v1/models/{name}/predict"
            answer = c.post(path, json=body)
            assert answer.status_code == status and valid(doc, component, body) is (status == 200), (body, answer.text)
            assert status == 200 or answer.json()["error"], body  # every 400 names the problem
