"""Schemathesis hooks for the run over the whole OpenAPI document (tests/test_reliability.py): what the document
states but a generated request cannot show."""

from __future__ import annotations

import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

# The relations between fields that JSON Schema cannot state (the request schemas say which: service/protocol/v2.py
# and simple.py): a schema-valid request may break one, and the service's 400 names it in these words.
UNSTATABLE = {
    "data holds prod(shape) values": r"shape \[[\d, ]*\] (needs \d+ values, data has|does not match \d+ strings)",
    "attention_mask has the shape of input_ids": r"^attention_mask shape \[[\d, ]*\] differs from input_ids",
    "rows have one length": r": data is not a rectangular array",
    "every mask row has a token": r"^row \d+ has no tokens \(attention_mask is all 0\)$",
    "a text's UTF-8 bytes fit max_len": r"^text encodes to \d+ tokens \(1 BOS \+ \d+ UTF-8 bytes\)",
    # JSON Schema's integer is any number with no fraction (1.0 too); the service takes integers written as such
    "integers are written as integers": r"(: Input should be a valid integer|: data must be integers, got float)",
    # a route's weights (service/config.py Route: each is >= 0 and finite, not so their sum) and name
    # (service/routes.py); "not all 0" can be stated, but then too few generated bodies pass it
    "a route's weights do not sum to 0": r"targets: Value error, the weights must not sum to 0",
    "a route's weights sum to a finite number": r"targets: Value error, the weights must sum to a finite number",
    "a route is not named like a model": r": a route cannot be named like a model$",
}
BINARY_HEADER = "inference-header-content-length"


@schemathesis.hook
def filter_case(context, case) -> bool:
    """No binary tensor data: the body after its JSON header is raw tensor bytes, which no generated body (nor a
    JSON body with a generated header length) can be; tests/test_api_v2_binary.py sends real ones."""
    headers = {name.lower() for name in case.headers or {}}
    return case.media_type != "application/octet-stream" and BINARY_HEADER not in headers


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Keep every failure but a schema-valid request refused for one of the UNSTATABLE relations."""
    if not isinstance(failure, RejectedPositiveData) or response.status_code != 400:
        return True
    error = response.json().get("error", "")
    error = error.get("message", "") if isinstance(error, dict) else error  # OpenAI's shape under /openai/
    return not any(re.search(pattern, error) for pattern in UNSTATABLE.values())
