"""The HTTP inference handlers: a request's body read within the limits and decoded (v2 JSON or binary tensor
data, the simple JSON API, attention) into the data plane's typed request, admitted, and its result encoded. No
torch.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from service import attention_api
from service.dataplane import DataPlane, Endpoint
from service.errors import BadRequestError
from service.http.limits import read_body
from service.protocol import binary, simple, v2
from service.protocol.parsing import BodyT, parse_body
from service.responses import binary_response, json_response
from service.routes import ROUTE_KEY

# the endpoint label of each; the ingress's own server counts HTTP requests from their head (service/load.py)
V2_INFER = Endpoint("v2_infer", counted=True)
PREDICT = Endpoint("v1_predict", counted=True)
ATTENTION = Endpoint("v1_attention", counted=True, per_model="attention maps are per model")


async def json_body(request: Request, plane: DataPlane, model: type[BodyT]) -> BodyT:
    """The request's JSON body, read within the limits and parsed as `model` (binary tensor data is v2's only)."""
    if binary.HEADER in request.headers:
        raise BadRequestError(f"binary tensor data ({binary.HEADER_NAME}) is for POST /v2/models/{{name}}/infer")
    return parse_body(await read_body(request, plane.limits), model)


async def v2_infer(plane: DataPlane, request: Request, name: str, version: str | None = None) -> Response:
    """Open Inference Protocol v2 inference, JSON or binary tensor data, of a model or a route."""
    async with plane.admit(V2_INFER, name, request.headers.get(ROUTE_KEY), version) as call:
        raw = await read_body(request, plane.limits)
        lengths = request.headers.getlist(binary.HEADER)
        if len(lengths) > 1:  # one value or none: another reader (a proxy) might take the other
            raise BadRequestError(f"{binary.HEADER_NAME} given {len(lengths)} times: send it once")
        header, blob = binary.split(raw, lengths[0] if lengths else None)
        body = parse_body(header, v2.InferRequest)
        binary.attach(body, blob)
        as_binary = binary.wants_binary(body)
        result = await call.infer(v2.to_request(body))
        if as_binary:
            return binary_response(*binary.infer_response(result.model, body, result.logits), binary.HEADER_NAME)
        return json_response(v2.infer_response(result.model, body, result.logits))


async def predict(plane: DataPlane, request: Request, name: str) -> Response:
    """Simple JSON inference, of a model or a route, with the request's timing."""
    async with plane.admit(PREDICT, name, request.headers.get(ROUTE_KEY)) as call:
        start = time.perf_counter()
        body = await json_body(request, plane, simple.PredictRequest)
        result = await call.infer(simple.to_request(body))
        return json_response(simple.predict_response(body, result, time.perf_counter() - start))


async def attention(plane: DataPlane, request: Request, name: str) -> Response:
    """One text's per-layer, per-head attention weights (a model's, not a route's)."""
    async with plane.admit(ATTENTION, name) as call:
        body = await json_body(request, plane, attention_api.AttentionRequest)
        return json_response(attention_api.response(await call.attention(body.text, body.layer)))
