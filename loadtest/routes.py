"""A route from the client's side: which model each answer says answered it (per protocol), and a level's share per
target beside the route's weights, in one line for the console. No torch, nothing of `service/`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from google.protobuf.message import DecodeError

from contract.binary_tensors import HEADER_NAME
from contract.rpc import inference_pb2 as pb
from loadtest.http_client import Response
from loadtest.stats import LevelResult

UNNAMED = "(not named)"  # an answer that does not say which model answered: counted, so the shares still add up


def _json_field(body: bytes, key: str) -> str:
    try:
        answer = json.loads(body)
    except ValueError:
        return ""
    value = answer.get(key) if isinstance(answer, dict) else None
    return value if isinstance(value, str) else ""


def simple_model(response: Response) -> str:
    """The simple JSON answer's `model`."""
    return _json_field(response.body, "model")


def v2_model(response: Response) -> str:
    """The v2 JSON answer's `model_name`."""
    return _json_field(response.body, "model_name")


def v2_binary_model(response: Response) -> str:
    """The `model_name` of a binary answer's JSON header (its length in the answer's head)."""
    length = response.headers.get(HEADER_NAME.lower(), "")
    return _json_field(response.body[: int(length)], "model_name") if length.isdigit() else ""


def grpc_model(response: Response) -> str:
    """ModelInferResponse.model_name of a gRPC answer (the serialized message)."""
    try:
        return pb.ModelInferResponse.FromString(response.body).model_name
    except DecodeError:
        return ""


ANSWERED_BY: dict[str, Callable[[Response], str]] = {
    "simple": simple_model,
    "v2": v2_model,
    "v2-binary": v2_binary_model,
    "grpc": grpc_model,
}


def _percent(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def shares_line(r: LevelResult) -> str:
    """Each model's share of the answers, with its configured weight: "mha-h8-d512 90.2% (weight 90.0%), ..."."""
    weights = r.weight_shares
    parts = []
    for model, share in r.shares.items():
        weight = f"weight {_percent(weights[model])}" if model in weights else "not a target"
        parts.append(f"{model} {_percent(share)} ({weight})")
    return ", ".join(parts) or "no answers"


def agreement_line(r: LevelResult) -> str:
    """The shadow's agreement in a few words ("" for a route without a shadow)."""
    shadow = r.shadow
    if not shadow:
        return ""
    if "rows" not in shadow:
        return f"shadow {shadow.get('model')}: agreement n/a ({shadow.get('note', 'no data')})"
    compared = shadow.get("requests", {}).get("compared", 0)  # type: ignore[union-attr]
    return (
        f"shadow {shadow.get('model')}: agreement {_percent(r.agreement_rate)} of {shadow['rows']:g} rows "
        f"({compared:g} mirrored requests compared)"
    )


def summary(r: LevelResult) -> str:
    """A route level's shares and agreement in one line."""
    agreement = agreement_line(r)
    return f"shares {shares_line(r)}" + (f"; {agreement}" if agreement else "")
