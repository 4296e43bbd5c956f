"""A request body as its pydantic model, whatever the transport: JSON bytes (HTTP) or the values a message carried
(gRPC), each refusal a 400 naming the fields pydantic refused, in the same words either way. No torch.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from service.errors import BadRequestError

BodyT = TypeVar("BodyT", bound=BaseModel)


def describe_errors(errors: list) -> str:
    """pydantic's errors in one line: where and what, the first five."""
    problems = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(problems)


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """The JSON body as `model`, whatever the Content-Type (curl -d sends form-encoded); 400 naming the problem."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            raise BadRequestError(f"malformed JSON body: {errors[0].get('msg', '')}") from None
        raise BadRequestError("invalid request: " + describe_errors(errors)) from None


def validated(values: dict[str, Any], model: type[BodyT]) -> BodyT:
    """`values` (decoded from a message) as `model`; 400 naming the problem."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise BadRequestError("invalid request: " + describe_errors(exc.errors())) from None
