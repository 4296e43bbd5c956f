"""The Open Inference Protocol's binary tensor data extension (Triton's): a request body is a JSON header of
`Inference-Header-Content-Length` bytes followed by the raw bytes of the inputs that say `binary_data_size`, in their
order; outputs asked for with `binary_data` (or `binary_data_output` for all) come back the same way.

Tensors are little-endian, row-major; a BYTES element is a 4-byte little-endian length and that many bytes. Every
malformed case is a BadRequestError naming it. No torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from contract.binary_tensors import BYTES_LENGTH, HEADER_NAME
from contract.metadata import LOGITS
from service.errors import BadRequestError
from service.protocol.v2 import InferRequest, RequestInput, response_head

HEADER = HEADER_NAME.lower()  # as ASGI gives head fields: HTTP header names are case-free
NUMERIC = {"INT64": np.dtype("<i8")}  # the numeric input datatypes the models take
DESCRIPTION = (  # the v2 infer routes' OpenAPI description
    "JSON tensor data as the schema says, or the binary tensor data extension: a body of the JSON header "
    "(`Inference-Header-Content-Length` bytes; 0, as no header, means the whole body is JSON) followed by the raw "
    "little-endian bytes of each input whose `parameters.binary_data_size` says how many, in the order of `inputs` "
    "(BYTES elements: a 4-byte little-endian length, then the UTF-8 bytes). `logits` comes back binary when its "
    "output's `parameters.binary_data` or the request's `parameters.binary_data_output` is true: an "
    "`application/octet-stream` body, the JSON header's length in `Inference-Header-Content-Length`."
)


def split(raw: bytes, header_length: str | None) -> tuple[bytes, memoryview | None]:
    """(JSON header, the binary data after it); None for the binary part when the request has no header length, or
    a length of 0: as Triton reads it (a missing header counts as 0 there), the whole body is then JSON."""
    if header_length is None:
        return raw, None
    text = header_length.strip()
    if not text.isdigit():
        raise BadRequestError(f"{HEADER_NAME} must be a byte count (a non-negative integer), got {header_length!r}")
    size = int(text)
    if size == 0:
        return raw, None
    if size > len(raw):
        raise BadRequestError(f"{HEADER_NAME} is {size}, past the end of the {len(raw)}-byte body")
    view = memoryview(raw)
    return bytes(view[:size]), view[size:]


def attach(request: InferRequest, blob: memoryview | None) -> None:
    """Give every input that says `binary_data_size` its bytes of `blob`, decoded into its `data`."""
    offset = 0
    for tensor in request.inputs:
        size = (tensor.parameters or {}).get("binary_data_size")
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise BadRequestError(f"input {tensor.name!r}: binary_data_size must be a byte count, got {size!r}")
        if blob is None:
            raise BadRequestError(
                f"input {tensor.name!r} has binary_data_size but the request has no {HEADER_NAME} header (or 0: "
                "the body is all JSON)"
            )
        if tensor.data is not None:
            raise BadRequestError(f"input {tensor.name!r} has both 'data' and binary_data_size: send one")
        if offset + size > len(blob):
            raise BadRequestError(
                f"the inputs' binary_data_size add up to more than the {len(blob)} bytes after the JSON header"
            )
        tensor.data = decode_tensor(tensor, blob[offset : offset + size])
        offset += size
    if blob is not None and offset != len(blob):
        raise BadRequestError(
            f"{len(blob) - offset} bytes after the JSON header belong to no input "
            f"(the inputs' binary_data_size add up to {offset} of {len(blob)})"
        )


def decode_tensor(tensor: RequestInput, chunk: memoryview) -> np.ndarray | list[str]:
    """One input's raw bytes (binary tensor data, or gRPC's raw_input_contents) as INT64 values or BYTES strings."""
    if any(d < 0 for d in tensor.shape):
        raise BadRequestError(f"input {tensor.name!r}: shape {tensor.shape} has a negative dimension")
    count = math.prod(tensor.shape)
    if tensor.datatype == "BYTES":
        return _strings(tensor.name, chunk, count)
    dtype = NUMERIC.get(tensor.datatype)
    if dtype is None:
        raise BadRequestError(f"input {tensor.name!r}: datatype {tensor.datatype} is not INT64 or BYTES")
    if len(chunk) % dtype.itemsize:
        raise BadRequestError(
            f"input {tensor.name!r}: {len(chunk)} bytes are not a whole number of {tensor.datatype} values "
            f"({dtype.itemsize} bytes each)"
        )
    values = np.frombuffer(chunk, dtype)  # a view of the body: no copy
    if values.size != count:
        raise BadRequestError(
            f"input {tensor.name!r}: shape {tensor.shape} needs {count} values, its binary data holds {values.size}"
        )
    return values


def _strings(name: str, chunk: memoryview, count: int) -> list[str]:
    """A BYTES tensor's elements: each a 4-byte little-endian length, then that many bytes of UTF-8 text."""
    out: list[str] = []
    pos, end = 0, len(chunk)
    while pos < end:
        if len(out) == count:
            raise BadRequestError(f"input {name!r}: more than the {count} BYTES elements its shape says")
        if pos + BYTES_LENGTH > end:
            raise BadRequestError(f"input {name!r}: the length of BYTES element {len(out)} is cut off")
        length = int.from_bytes(chunk[pos : pos + BYTES_LENGTH], "little")
        pos += BYTES_LENGTH
        if pos + length > end:
            raise BadRequestError(f"input {name!r}: BYTES element {len(out)} of {length} bytes runs past its data")
        try:
            out.append(bytes(chunk[pos : pos + length]).decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequestError(f"input {name!r}: BYTES element {len(out)} is not UTF-8 text") from None
        pos += length
    if len(out) != count:
        raise BadRequestError(f"input {name!r}: shape needs {count} BYTES elements, its binary data holds {len(out)}")
    return out


def _flag(parameters: dict[str, Any] | None, key: str, where: str) -> bool | None:
    value = (parameters or {}).get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequestError(f"{where}: parameter {key!r} must be true or false, got {value!r}")
    return value


def wants_binary(request: InferRequest) -> bool:
    """Whether `logits` goes back as binary data: its own `binary_data`, else the request's `binary_data_output`."""
    default = _flag(request.parameters, "binary_data_output", "request") or False
    for out in request.outputs or []:
        if (out.parameters or {}).get("classification") is not None:
            raise BadRequestError(f"output {out.name!r}: the classification extension is not supported")
        own = _flag(out.parameters, "binary_data", f"output {out.name!r}")
        if own is not None:
            return own
    return default


def infer_response(name: str, request: InferRequest, logits: np.ndarray) -> tuple[bytes, bytes]:
    """(JSON header, raw bytes): `logits` FP32 [B, C] as little-endian row-major binary data, the request id echoed."""
    raw = np.ascontiguousarray(logits, dtype="<f4").tobytes()
    header = response_head(name, request)
    tensor = {"name": LOGITS, "datatype": "FP32", "shape": list(logits.shape)}
    header["outputs"] = [{**tensor, "parameters": {"binary_data_size": len(raw)}}]
    return orjson.dumps(header), raw
