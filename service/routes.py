"""Routes: names served like a model that send each request to one of their target models by weight, and mirror a
share of their requests to a shadow model. The table is checked against the served models once, when it is installed
(at start or on a redeploy), and swapped whole, so a request in progress keeps the target it was given. No torch.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from service.route_config import ROUTE_NAME, Route

ROUTE_KEY = "x-route-key"  # HTTP header (gRPC: metadata key) pinning a request to a target for the same weights


class RouteConfigError(ValueError):
    """A route that cannot be served (an unknown target, a route named like a model): one line naming it."""


def _unit(key: str) -> float:
    """A routing key -> a number in [0, 1), the same on every replica and every run."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True)
class RoutePlan:
    """One route: its targets in name order with their cumulative shares, and its shadow."""

    name: str
    weights: Mapping[str, float]  # as configured (the model list shows them)
    targets: tuple[str, ...]  # sorted by name: a key's target depends on the weights only, not on their order
    bounds: tuple[float, ...]  # cumulative shares, the last 1.0; a target of weight 0 is never below any draw
    shadow: str | None = None
    fraction: float = 0.0

    @classmethod
    def of(cls, name: str, route: Route) -> RoutePlan:
        targets = tuple(sorted(route.targets))
        total = sum(route.targets.values())
        bounds, running = [], 0.0
        for target in targets:
            running += route.targets[target]
            bounds.append(running / total)
        bounds[-1] = 1.0  # no draw may fall past the last target through rounding
        shadow = route.shadow
        return cls(
            name,
            dict(route.targets),
            targets,
            tuple(bounds),
            shadow.model if shadow else None,
            shadow.fraction if shadow else 0.0,
        )

    def pick(self, key: str | None) -> str:
        """The target of one request: drawn by weight, or fixed by its routing key."""
        draw = random.random() if key is None else _unit(key)
        return self.targets[bisect.bisect_right(self.bounds, draw)]

    def mirrors(self, target: str) -> bool:
        """Whether this request (answered by `target`) is mirrored to the shadow: never to the model that answered."""
        if self.shadow is None or self.shadow == target or self.fraction <= 0.0:
            return False
        return self.fraction >= 1.0 or random.random() < self.fraction

    @property
    def heaviest(self) -> str:
        """The target of the largest weight (the first by name among equals)."""
        return max(self.targets, key=lambda t: self.weights[t])

    def describe(self, ready: bool) -> dict[str, Any]:
        shadow = {"model": self.shadow, "fraction": self.fraction} if self.shadow else None
        return {"name": self.name, "targets": dict(self.weights), "shadow": shadow, "ready": ready}


@dataclass(frozen=True)
class RouteTable:
    """Every route, checked against the served models."""

    plans: Mapping[str, RoutePlan] = field(default_factory=dict)

    @classmethod
    def build(cls, routes: Mapping[str, Route | dict], models: list[str]) -> RouteTable:
        """The table of `routes` (config objects, or their dicts from a Serve user_config); RouteConfigError naming
        the first route that cannot be served by `models`."""
        plans = {}
        for name, raw in routes.items():
            route = raw if isinstance(raw, Route) else _parsed(name, raw)
            where = f"routes.{name}"
            if not re.fullmatch(ROUTE_NAME, name):
                raise RouteConfigError(
                    f"{where}: a route's name is 1 to 128 letters, digits, '.', '_' or '-', from a letter or digit"
                )
            if name in models:
                raise RouteConfigError(f"{where}: a route cannot be named like a model")
            for target in route.targets:
                if target not in models:
                    raise RouteConfigError(f"{where}.targets: unknown model {target!r}; models: {models}")
            if route.shadow is not None and route.shadow.model not in models:
                raise RouteConfigError(f"{where}.shadow.model: unknown model {route.shadow.model!r}; models: {models}")
            plans[name] = RoutePlan.of(name, route)
        return cls(plans)

    def get(self, name: str) -> RoutePlan | None:
        return self.plans.get(name)

    def resolve(self, name: str, key: str | None) -> tuple[str, RoutePlan | None]:
        """The model that answers a request for `name` (a route's pick, else `name` itself) and the route, if any."""
        plan = self.plans.get(name)
        return (name, None) if plan is None else (plan.pick(key), plan)

    @property
    def names(self) -> list[str]:
        return list(self.plans)


def _parsed(name: str, raw: dict) -> Route:
    """A route from a user_config dict; RouteConfigError with the first problem, as the CLI's config errors read."""
    try:
        return Route.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(["routes", name, *(str(p) for p in first["loc"])])
        raise RouteConfigError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
