"""Open Inference Protocol v2 (KServe / Triton), JSON tensors: request models, decoding, response building.

Inputs: `input_ids` + optional `attention_mask` (INT64 [B, T]) or `text` (BYTES [B]); output `logits` FP32 [B, C].
No torch.
"""

from __future__ import annotations

from importlib.metadata import version as package_version
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from contract.binary_tensors import EXTENSION
from contract.decoder_metadata import DecoderMetadata
from contract.metadata import ATTENTION_MASK, CLASSIFIER, INPUT_IDS, LOGITS, ModelMetadata
from service.errors import BadRequestError
from service.inference import MODEL_VERSION, InferenceRequest
from service.protocol.generate import decoder_metadata
from service.validation import MASK_VALUE, Bounds, Schema, int_matrix

TEXT = "text"
PLATFORM = "onnxruntime_onnx"
KNOWN_INPUTS = (INPUT_IDS, ATTENTION_MASK, TEXT)


class RequestInput(BaseModel):
    """One input tensor: `input_ids` / `attention_mask` INT64 [B, T], or `text` BYTES [B]; flat row-major `data`."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """The v2 inference request; unknown top-level keys are tolerated, as the protocol allows extensions."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class Live(BaseModel):
    """The server is up."""

    live: bool


class Ready(BaseModel):
    """Every model is ready (503 with `error` otherwise, and while shutting down)."""

    ready: bool


class ServerMetadata(BaseModel):
    """The server's name and version."""

    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]  # -1: dynamic


class ModelMetadataResponse(BaseModel):
    """The model's inputs and outputs, and its head configuration under `parameters`."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any]


class ModelReady(BaseModel):
    """The model is ready (503 with `error` otherwise)."""

    name: str
    ready: bool


class ResponseOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float]


class InferResponse(BaseModel):
    """`logits` FP32 [B, C] as flat row-major data; the request's `id` echoed when it had one."""

    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[ResponseOutput]


FLAG = {"type": ["boolean", "null"]}
NO_BINARY = {"type": ["object", "null"], "properties": {"binary_data_size": {"type": "null"}}}  # JSON: no binary part
OUTPUT_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"const": LOGITS},
        "parameters": {
            "type": ["object", "null"],
            "properties": {
                "binary_data": FLAG | {"description": "true: logits come back as binary tensor data"},
                "classification": {"type": "null", "description": "the classification extension is not served"},
            },
        },
    },
}


def request_schemas(bounds: Bounds, ref: str) -> dict[str, Schema]:
    """JSON Schemas of the infer body (InferRequest) and of a binary request's JSON header (InferRequestHeader),
    with their parts, named as the document's components (`ref`: the $ref template). What JSON Schema cannot
    state is left to the service's 400s: `data` holds prod(`shape`) values, `attention_mask` has the shape of
    `input_ids`, every mask row has a token, a text's UTF-8 bytes fit max_len."""
    tensors = {
        "IdsInput": _matrix(INPUT_IDS, bounds, bounds.token_id()),
        "MaskInput": _matrix(ATTENTION_MASK, bounds, MASK_VALUE),
    }
    if bounds.text:
        tensors["TextInput"] = _texts(bounds)
    sets = [[INPUT_IDS], [INPUT_IDS, ATTENTION_MASK], [ATTENTION_MASK, INPUT_IDS]] + [[TEXT]] * bounds.text
    kind = {INPUT_IDS: "IdsInput", ATTENTION_MASK: "MaskInput", TEXT: "TextInput"}

    def inputs(schema_of) -> Schema:
        tuples = [[schema_of(kind[name]) for name in names] for names in sets]
        return {"anyOf": [{"type": "array", "prefixItems": t, "minItems": len(t), "maxItems": len(t)} for t in tuples]}

    json_inputs = inputs(lambda name: {"$ref": ref.format(model=name)})
    header_inputs = inputs(lambda name: _data_or_binary(tensors[name]))
    return {
        **tensors,
        "RequestOutput": OUTPUT_SCHEMA,
        "InferRequest": _request(json_inputs, ref, "The v2 inference request, JSON tensor data."),
        "InferRequestHeader": _request(header_inputs, ref, "A binary tensor data request's JSON header."),
    }


def _request(inputs: Schema, ref: str, description: str) -> Schema:
    """A v2 request with these `inputs`; unknown top-level keys are tolerated, as the protocol allows extensions."""
    return {
        "type": "object",
        "description": description,
        "required": ["inputs"],
        "properties": {
            "id": {"type": ["string", "null"]},
            "parameters": {
                "type": ["object", "null"],
                "properties": {"binary_data_output": FLAG | {"description": "true: every output as binary data"}},
            },
            "inputs": inputs,
            "outputs": {"type": ["array", "null"], "items": {"$ref": ref.format(model="RequestOutput")}},
        },
    }


def _tensor_schema(name: str, datatype: str, shape: Schema, data: Schema) -> Schema:
    properties = {"name": {"const": name}, "datatype": {"const": datatype}, "shape": shape, "data": data}
    return {"type": "object", "required": list(properties), "properties": properties | {"parameters": NO_BINARY}}


def _matrix(name: str, bounds: Bounds, value: Schema) -> Schema:
    """An INT64 [B, T] input, `data` flat row-major or nested; `value`: one element's schema."""
    data = {"anyOf": [bounds.flat(value), bounds.rows(bounds.row(value))]}
    return _tensor_schema(name, "INT64", bounds.shape(matrix=True), data)


def _texts(bounds: Bounds) -> Schema:
    """The BYTES [B] input of texts: `data` a list of strings (or one string when B is 1)."""
    text = bounds.text_schema()
    return _tensor_schema(TEXT, "BYTES", bounds.shape(matrix=False), {"anyOf": [text, bounds.rows(text)]})


def _data_or_binary(tensor: Schema) -> Schema:
    """An input of a binary request's header: its JSON `data`, or `binary_data_size` bytes after the header."""
    properties = {k: v for k, v in tensor["properties"].items() if k not in ("data", "parameters")}
    size = {"type": "integer", "minimum": 0, "description": "bytes of this input after the JSON header, in order"}
    binary = {"type": "object", "required": ["binary_data_size"], "properties": {"binary_data_size": size}}
    as_json = {"required": ["data"], "properties": {"data": tensor["properties"]["data"], "parameters": NO_BINARY}}
    as_binary = {"required": ["parameters"], "properties": {"data": {"type": "null"}, "parameters": binary}}
    return {"type": "object", "required": list(properties), "properties": properties, "oneOf": [as_json, as_binary]}


def _tensor(inputs: dict[str, RequestInput], name: str, datatype: str) -> RequestInput | None:
    tensor = inputs.get(name)
    if tensor is None:
        return None
    if tensor.datatype != datatype:
        raise BadRequestError(f"input {name!r} must have datatype {datatype}, got {tensor.datatype}")
    if tensor.data is None:
        raise BadRequestError(f"input {name!r} has no 'data'")
    return tensor


def to_request(request: InferRequest) -> InferenceRequest:
    """The decoded request; BadRequestError names the tensor and the problem."""
    inputs = {t.name: t for t in request.inputs}
    unknown = [n for n in inputs if n not in KNOWN_INPUTS]
    if unknown or len(inputs) != len(request.inputs):
        raise BadRequestError(
            f"unexpected or repeated inputs {unknown or [t.name for t in request.inputs]}; "
            f"send {INPUT_IDS} (+ {ATTENTION_MASK}) or {TEXT}"
        )
    outputs = tuple(out.name for out in request.outputs or ())
    text = _tensor(inputs, TEXT, "BYTES")
    if text is not None:
        if len(inputs) > 1:
            raise BadRequestError(f"send either {TEXT} or {INPUT_IDS}/{ATTENTION_MASK}, not both")
        data = text.data if isinstance(text.data, list) else [text.data]
        if len(text.shape) != 1 or text.shape[0] != len(data):
            raise BadRequestError(f"input {TEXT!r}: shape {text.shape} does not match {len(data)} strings")
        return InferenceRequest(texts=data, outputs=outputs)
    ids = _tensor(inputs, INPUT_IDS, "INT64")
    if ids is None:
        raise BadRequestError(f"input {INPUT_IDS!r} is missing (or send {TEXT!r})")
    mask = _tensor(inputs, ATTENTION_MASK, "INT64")
    ids_m = int_matrix(INPUT_IDS, ids.data, ids.shape)
    mask_m = int_matrix(ATTENTION_MASK, mask.data, mask.shape) if mask is not None else None
    return InferenceRequest(ids_m, mask_m, outputs=outputs)


def response_head(name: str, request: InferRequest) -> dict[str, Any]:
    """A v2 infer response's model name and version, and the request's id echoed when it had one."""
    out: dict[str, Any] = {"model_name": name, "model_version": MODEL_VERSION}
    if request.id is not None:
        out["id"] = request.id
    return out


def infer_response(name: str, request: InferRequest, logits: np.ndarray) -> dict[str, Any]:
    """The v2 response: `logits` FP32 [B, C] as flat row-major JSON data, the request id echoed."""
    out = response_head(name, request)
    tensor = {"name": LOGITS, "datatype": "FP32", "shape": list(logits.shape), "data": logits.ravel().tolist()}
    out["outputs"] = [tensor]  # the only output; the data plane refused any other name
    return out


def server_metadata(server_name: str) -> dict[str, Any]:
    """v2 server metadata: the server's name, the package's version, the extensions served."""
    return {"name": server_name, "version": package_version("mha-serving"), "extensions": [EXTENSION]}


def model_metadata(meta: ModelMetadata | DecoderMetadata) -> dict[str, Any]:
    """v2 model metadata (tritonclient's get_model_metadata reads it); -1 marks dynamic dimensions. A decoder's
    says so (`arch`) and names its generate routes' text input and output."""
    if isinstance(meta, DecoderMetadata):
        return decoder_metadata(meta, PLATFORM)
    return {
        "name": meta.name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [
            {"name": INPUT_IDS, "datatype": "INT64", "shape": [-1, -1]},
            {"name": ATTENTION_MASK, "datatype": "INT64", "shape": [-1, -1]},
        ],
        "outputs": [{"name": LOGITS, "datatype": "FP32", "shape": [-1, meta.num_classes]}],
        "parameters": {
            "heads": meta.heads,
            "head_dim": meta.head_dim,
            "d_model": meta.d_model,
            "layers": meta.layers,
            "precision": meta.precision,
            "max_len": meta.max_len,
            "vocab_size": meta.vocab_size,
            "labels": list(meta.labels),
            "text_input": f"{TEXT} (BYTES [-1]) instead of {INPUT_IDS}/{ATTENTION_MASK}" if meta.takes_text else "",
            "arch": CLASSIFIER,
        },
    }
