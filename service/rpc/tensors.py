"""gRPC messages to and from the v2 request the HTTP routes decode: a ModelInferRequest becomes a v2.InferRequest
(typed `contents` or `raw_input_contents`), logits become a ModelInferResponse with `raw_output_contents`, as Triton
answers. Malformed messages are BadRequestErrors naming the problem, like the HTTP routes'. No torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from contract.metadata import LOGITS
from contract.rpc import inference_pb2 as pb
from service.errors import BadRequestError
from service.protocol import binary, v2


def _value(parameter: pb.InferParameter) -> Any:
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def _parameters(entries) -> dict[str, Any] | None:
    return {key: _value(value) for key, value in entries.items()} or None


def _contents(tensor: v2.RequestInput, contents: pb.InferTensorContents) -> np.ndarray | list[str]:
    if tensor.datatype == "BYTES":
        try:
            return [element.decode("utf-8") for element in contents.bytes_contents]
        except UnicodeDecodeError:
            raise BadRequestError(f"input {tensor.name!r}: an element of bytes_contents is not UTF-8 text") from None
    if tensor.datatype == "INT64":
        return np.fromiter(contents.int64_contents, dtype=np.int64, count=len(contents.int64_contents))
    raise BadRequestError(f"input {tensor.name!r}: datatype {tensor.datatype} is not INT64 or BYTES")


def to_request(message: pb.ModelInferRequest) -> v2.InferRequest:
    """The v2 request of a ModelInferRequest, each input's data decoded from its contents or its raw bytes."""
    if not message.inputs:
        raise BadRequestError("the request has no inputs")
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise BadRequestError(
            f"raw_input_contents has {len(raw)} entries for {len(message.inputs)} inputs: send one per input"
        )
    inputs = []
    for i, tensor in enumerate(message.inputs):
        shape = list(tensor.shape)
        item = v2.RequestInput(name=tensor.name, datatype=tensor.datatype, shape=shape)
        if raw:
            if tensor.HasField("contents"):
                raise BadRequestError(f"input {tensor.name!r} has contents beside raw_input_contents: send one")
            item.data = binary.decode_tensor(item, memoryview(raw[i]))
        elif tensor.HasField("contents"):
            item.data = _contents(item, tensor.contents)
        inputs.append(item)
    outputs = [v2.RequestOutput(name=o.name, parameters=_parameters(o.parameters)) for o in message.outputs]
    return v2.InferRequest(
        id=message.id or None, parameters=_parameters(message.parameters), inputs=inputs, outputs=outputs or None
    )


def to_response(name: str, request: v2.InferRequest, logits: np.ndarray) -> pb.ModelInferResponse:
    """`logits` FP32 [B, C] as little-endian raw output contents, the request id echoed."""
    response = pb.ModelInferResponse(model_name=name, model_version=v2.MODEL_VERSION, id=request.id or "")
    response.outputs.add(name=LOGITS, datatype="FP32", shape=list(logits.shape))
    response.raw_output_contents.append(np.ascontiguousarray(logits, dtype="<f4").tobytes())
    return response


def model_metadata(metadata: dict[str, Any]) -> pb.ModelMetadataResponse:
    """v2 model metadata (the HTTP route's dict) as the gRPC message (which has no `parameters`)."""
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata["versions"],
        platform=metadata["platform"],
        inputs=[tensor(**t) for t in metadata["inputs"]],
        outputs=[tensor(**t) for t in metadata["outputs"]],
    )
