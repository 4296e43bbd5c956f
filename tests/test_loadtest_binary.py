"""The load tester's binary tensor data requests, decoded by the server's own decoder, and its check of the answers:
the server's own binary answer passes, every malformed one is named."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.binary import HEADER_NAME, answer_problem, encode_request
from loadtest.http_client import Response
from loadtest.workload import request_body
from service.protocol import binary as server_binary
from service.protocol.v2 import InferRequest

TEXTS = ["a fine film", "", "é ünïcode ✓", "attention " * 12]


def decoded(content: bytes, header_length: str) -> InferRequest:
    """The request as the service reads it: header split off, JSON parsed, binary data attached to its inputs."""
    header, blob = server_binary.split(content, header_length)
    request = InferRequest.model_validate_json(header)
    server_binary.attach(request, blob)
    return request


def test_the_service_decodes_the_body_to_the_same_texts_and_sends_logits_back_binary():
    body = request_body("v2-binary", TEXTS)
    request = decoded(body.content, dict(body.headers)[HEADER_NAME])
    (text,) = request.inputs
    assert (text.name, text.datatype, text.shape, text.data) == ("text", "BYTES", [len(TEXTS)], TEXTS)
    assert server_binary.wants_binary(request)
    assert (body.sequences, body.tokens) == (len(TEXTS), sum(len(t.encode("utf-8")) + 1 for t in TEXTS))


def test_each_text_is_a_four_byte_little_endian_length_then_its_utf8_bytes():
    content, header_length = encode_request(TEXTS)
    data, expected = content[header_length:], b""
    for text in TEXTS:
        raw = text.encode("utf-8")
        expected += len(raw).to_bytes(4, "little") + raw
    assert data == expected


CLASSES = 2


def server_answer(rows: int) -> Response:
    """The service's own binary answer of `rows` x CLASSES logits, as the HTTP client reads it."""
    body = request_body("v2-binary", TEXTS[:rows])
    request = decoded(body.content, dict(body.headers)[HEADER_NAME])
    logits = np.random.default_rng(rows).standard_normal((rows, CLASSES)).astype(np.float32)  # (B, C)
    header, raw = server_binary.infer_response("mha-h2-d32", request, logits)
    return Response(200, header + raw, {HEADER_NAME.lower(): str(len(header))})


def test_the_services_own_binary_answer_passes_the_check():
    for rows in (1, 3):
        assert answer_problem(server_answer(rows), rows) == ""


def _with(answer: Response, body: bytes | None = None, length: str | None = None) -> Response:
    headers = dict(answer.headers) if length is None else {HEADER_NAME.lower(): length}
    return Response(200, answer.body if body is None else body, headers)


GOOD = server_answer(3)
SIZE = int(GOOD.headers[HEADER_NAME.lower()])
MALFORMED = {  # case -> (answer, sequences asked, what the check says)
    "no header length": (Response(200, GOOD.body, {}), 3, "is missing"),
    "header length past the body": (_with(GOOD, length=str(len(GOOD.body) + 1)), 3, f"{len(GOOD.body) + 1} in an"),
    "header is not JSON": (_with(GOOD, length=str(SIZE - 1)), 3, "are not a JSON header"),
    "a JSON answer": (_with(GOOD, b'{"outputs": []}', "15"), 3, "has no 'logits' output"),
    "rows other than asked": (GOOD, 2, "not FP32 [2, classes]"),
    "logits cut short": (_with(GOOD, GOOD.body[:-4]), 3, f"{3 * CLASSES * 4 - 4} bytes follow the JSON header"),
    "bytes left over": (_with(GOOD, GOOD.body + b"\0"), 3, f"{3 * CLASSES * 4 + 1} bytes follow the JSON header"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_answer_is_named(case):
    answer, sequences, message = MALFORMED[case]
    assert message in answer_problem(answer, sequences)
