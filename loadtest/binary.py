"""The Open Inference Protocol's binary tensor data extension, client side: a v2 infer request whose texts travel as
BYTES binary data with the logits asked back binary (tritonclient.http's defaults), and the check of its answer.

The extension's framing is contract/binary_tensors.py. No torch, nothing of `service/`.
"""

from __future__ import annotations

import json
import math

from contract.binary_tensors import HEADER_NAME, encode_bytes
from contract.metadata import LOGITS
from loadtest.http_client import Response

_FP32_BYTES = 4


def encode_request(texts: list[str]) -> tuple[bytes, int]:
    """(body, JSON header length): the JSON header, then the texts as one BYTES input of binary data."""
    data = encode_bytes(t.encode("utf-8") for t in texts)
    text = {"name": "text", "datatype": "BYTES", "shape": [len(texts)], "parameters": {"binary_data_size": len(data)}}
    header = json.dumps({"inputs": [text], "parameters": {"binary_data_output": True}}, separators=(",", ":")).encode()
    return header + data, len(header)


def answer_problem(response: Response, sequences: int) -> str:
    """What is wrong with a 200 answer to `encode_request` of `sequences` texts ("" when nothing): its head must give
    the JSON header's length, and the header a `logits` output FP32 [sequences, classes] whose binary data is the
    rest of the body."""
    length = response.headers.get(HEADER_NAME.lower(), "")
    if not length.isdigit() or int(length) > len(response.body):
        return f"{HEADER_NAME} is {length or 'missing'} in an answer of {len(response.body)} bytes"
    size = int(length)
    try:
        header = json.loads(response.body[:size])
    except ValueError:
        return f"the answer's first {size} bytes are not a JSON header"
    outputs = header.get("outputs") if isinstance(header, dict) else None
    logits = next((o for o in outputs or [] if isinstance(o, dict) and o.get("name") == LOGITS), None)
    if logits is None:
        return f"the answer's JSON header has no {LOGITS!r} output: {response.body[:size][:200]!r}"
    shape = logits.get("shape")
    two_dims = isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape)
    if logits.get("datatype") != "FP32" or not two_dims or shape[0] != sequences:
        return f"{LOGITS} are {logits.get('datatype')} {shape}, not FP32 [{sequences}, classes]"
    expected = math.prod(shape) * _FP32_BYTES
    parameters = logits.get("parameters")
    declared = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if declared != expected or len(response.body) - size != expected:
        return (
            f"{LOGITS} FP32 {shape} take {expected} bytes; binary_data_size says {declared} and "
            f"{len(response.body) - size} bytes follow the JSON header"
        )
    return ""
