"""The OpenAPI document (built in-process, as the ingress serves it): every $ref resolves, every status the service
answers is documented with the one error body, answers have schemas, no 422, and "exactly one of text, texts,
input_ids" is part of the predict body's schema. Schemathesis runs over the served document in test_reliability.py."""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import pytest

from service.config import RequestLimits
from service.http.api import create_app

ERROR = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture(scope="module")
def document() -> dict:
    """The document of the one application; only its routes and served model names shape it."""
    ingress = SimpleNamespace(limits=RequestLimits(), model_names=["mha-h2-d32"])
    return create_app(ingress).openapi()


def operations(document: dict):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield f"{method.upper()} {path}", operation


def refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def test_every_ref_resolves(document):
    found = set(refs(document))
    assert "#/components/schemas/RequestInput" in found and "#/components/schemas/PredictRequest" in found
    for ref in found:
        node = document
        for part in ref.removeprefix("#/").split("/"):
            assert part in node, f"{ref} does not resolve"
            node = node[part]


def test_every_status_the_service_answers_is_documented_with_the_error_body_and_none_it_does_not(document):
    for name, operation in operations(document):
        statuses = set(operation["responses"])
        expected = {"200", "405", "413", "431"} | ({"400", "404", "408", "503"} if name.startswith("POST") else set())
        assert expected <= statuses and "422" not in statuses, (name, sorted(statuses))
        for status, response in operation["responses"].items():
            schema = response["content"]["application/json"]["schema"]
            assert schema == ERROR if status != "200" else schema["$ref"] != ERROR["$ref"], (name, status)
        assert operation["responses"]["405"]["headers"]["Allow"]["required"] is True
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and schemas["ErrorBody"]["required"] == ["error"]


def test_answers_have_schemas_with_their_fields(document):
    schemas = document["components"]["schemas"]
    for name, operation in operations(document):
        target = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
        assert schemas[target]["properties"], name
    assert {"logits", "probabilities", "predicted", "config"} <= set(schemas["PredictResponse"]["required"])


@pytest.mark.parametrize(
    "body,valid",
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
    ],
)
def test_the_predict_body_schema_says_exactly_one_of_text_texts_input_ids(document, body, valid):
    schema = document["components"]["schemas"]["PredictRequest"]
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(body))
    assert (not errors) is valid, [e.message for e in errors]


def test_path_parameters_list_this_servers_values_when_known(document):
    for name, operation in operations(document):
        for param in operation.get("parameters", []):
            assert param["in"] == "path" and param["schema"]["type"] == "string", (name, param)
            if param["name"] == "version":
                assert param["schema"]["enum"] == ["1"]
