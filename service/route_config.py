"""A route's typed configuration (its targets by weight, its shadow): part of the application's config
(service/config.py) and of the model repository API's bodies. Pydantic at the process boundary. No torch.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StringConstraints, field_validator


class Shadow(BaseModel):
    """A model that gets a copy of a share of a route's requests: its answers are compared with the answered ones
    (the agreement metrics), never returned."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(description="the shadow model's name")
    fraction: float = Field(
        1.0,
        description="the share of the route's requests mirrored to it, within [0, 1]",
        json_schema_extra={"minimum": 0, "maximum": 1},
    )

    @field_validator("fraction")
    @classmethod
    def _within_one(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"must be within [0, 1], got {value:g}")
        return value


# A route's name: served like a model's, in URL paths and metric labels (a request names it in its path).
ROUTE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RouteName = Annotated[str, StringConstraints(pattern=ROUTE_NAME)]
Weight = Annotated[StrictFloat, Field(allow_inf_nan=False, json_schema_extra={"minimum": 0})]


class Route(BaseModel):
    """A name served like a model that sends each request to one of its target models by weight."""

    model_config = ConfigDict(extra="forbid")
    targets: dict[str, Weight] = Field(
        description="model name -> weight (any non-negative numbers, not all 0): a target's share is its weight over "
        "the sum; a request with the same `x-route-key` header always reaches the same target for the same weights",
        json_schema_extra={"minProperties": 1},
    )
    shadow: Shadow | None = Field(None, description="a model mirrored a share of the requests, on spare capacity only")

    @field_validator("targets")
    @classmethod
    def _weights(cls, targets: dict[str, float]) -> dict[str, float]:
        negative = {name: weight for name, weight in targets.items() if weight < 0}
        if negative:
            raise ValueError(f"weights must not be negative: {negative}")
        total = sum(targets.values())
        if total <= 0:
            raise ValueError(f"the weights must not sum to 0: {targets or 'no targets'}")
        if not math.isfinite(total):  # each share is a weight over the sum
            raise ValueError(f"the weights must sum to a finite number: {targets}")
        return targets
