"""`mha-serving optimize --rollout shadow`: a candidate rolled out on a route of a running service. It is loaded
(the repository API), mirrored first (the route's shadow, on spare capacity), then given the incumbent's share of
the route in weight steps, the incumbent mirrored in its turn; each step is held while the candidate's live
agreement and p99 (read from the service's Prometheus metrics) hold, and the route is set back as it was when they
do not. A client of the service, like any other: the same against a local `mha-serving serve` and a cluster.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtest import agreement, server_metrics

LATENCY = "ray_mha_request_latency_seconds"
REQUESTS = "ray_mha_requests_total"
POLL_S = 1.0
SCRAPE_TRIES = 10


class RolloutError(RuntimeError):
    """The rollout cannot start or go on (the service refused a change, the route is unknown); one line."""


@dataclass(frozen=True)
class RolloutPlan:
    route: str
    candidate: str  # a model folder in the service's models_dir
    steps_pct: tuple[float, ...] = (1.0, 10.0, 50.0, 100.0)  # the candidate's share of the incumbent's weight
    hold_s: float = 30.0  # each step, at least
    min_rows: int = 200  # rows compared before a step is judged (it is held up to 4 x hold_s for them)
    min_agreement: float = 0.99
    slo_p99_ms: float | None = None


@dataclass(frozen=True)
class Step:
    name: str  # "shadow", or the candidate's share: "10%"
    route: dict[str, Any]  # the route as set for the step
    seconds: float
    rows: int  # rows compared (candidate against incumbent)
    agreement: float | None
    requests: int  # answered by the candidate
    errors: int  # of those, answered with a 5xx
    p99_ms: float | None
    verdict: str  # "held", or why the rollout was rolled back


@dataclass(frozen=True)
class RolloutResult:
    route: str
    incumbent: str
    candidate: str
    promoted: bool
    steps: list[Step] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "steps": [asdict(s) for s in self.steps]}


class ServiceAdmin:
    """The running service's repository API, with its token."""

    def __init__(self, base_url: str, header: str, token: str, timeout_s: float = 300.0) -> None:
        self._client = httpx.Client(base_url=base_url, headers={header: token}, timeout=timeout_s)

    def route(self, name: str) -> dict[str, Any]:
        """The route as the service lists it: {"targets": {model: weight}, "shadow": {...} | None}."""
        listing = self._client.get("/v1/models").json()
        for route in listing.get("routes", []):
            if route["name"] == name:
                return {"targets": route["targets"], "shadow": route["shadow"]}
        raise RolloutError(f"the service has no route {name!r}; routes: {[r['name'] for r in listing['routes']]}")

    def load(self, model: str) -> None:
        self._call("POST", f"/v2/repository/models/{model}/load", f"load {model!r}")

    def set_route(self, name: str, route: dict[str, Any]) -> None:
        self._call("PUT", f"/v2/repository/routes/{name}", f"set route {name!r}", json=route)

    def _call(self, method: str, path: str, what: str, **kwargs: Any) -> None:
        response = self._client.request(method, path, **kwargs)
        if response.status_code != 200:
            error = response.json().get("error", response.text) if response.content else ""
            raise RolloutError(f"the service refused to {what}: {response.status_code} {error}")


def step_route(original: dict[str, Any], incumbent: str, candidate: str, pct: float | None) -> dict[str, Any]:
    """The route at one step: None, the shadow step (the candidate mirrored, the incumbent answering); else the
    candidate given `pct` % of the incumbent's weight, the incumbent mirrored (the other targets as they were)."""
    targets = {k: float(v) for k, v in original["targets"].items()}
    if pct is None:
        return {"targets": targets, "shadow": {"model": candidate, "fraction": 1.0}}
    weight = targets[incumbent]
    targets[candidate] = weight * pct / 100.0
    targets[incumbent] = weight * (1.0 - pct / 100.0)
    return {"targets": targets, "shadow": {"model": incumbent, "fraction": 1.0}}


@dataclass(frozen=True)
class _Reading:
    """One scrape: the route's shadow counts, the candidate's latency buckets, its answers by status."""

    shadow: agreement.ShadowCounts
    latency: dict[float, float]
    by_code: dict[str, float]


def _read(client: httpx.Client, metrics_url: str, route: str, candidate: str) -> _Reading:
    for attempt in range(SCRAPE_TRIES):  # Ray's export answers a scrape 500 now and then while a replica changes
        try:
            text = server_metrics.fetch(client, metrics_url)
            break
        except server_metrics.MetricsError:
            if attempt == SCRAPE_TRIES - 1:
                raise
            time.sleep(POLL_S)
    latency = server_metrics.parse_histogram(text, LATENCY, {"model": candidate}).buckets.get(candidate, {})
    by_code = server_metrics.parse_counter(text, REQUESTS, {"model": candidate}, by="code")
    return _Reading(agreement.read(text, route, {}), latency, by_code)


def judge(plan: RolloutPlan, before: _Reading, after: _Reading, name: str, route: dict, seconds: float) -> Step:
    """A step's figures between two scrapes, and its verdict."""
    rows = round(after.shadow.rows - before.shadow.rows)
    agreeing = round(after.shadow.agreeing_rows - before.shadow.agreeing_rows)
    rate = agreeing / rows if rows > 0 else None
    buckets = {le: n - before.latency.get(le, 0.0) for le, n in after.latency.items()}
    p99 = server_metrics.bucket_quantile(buckets, 0.99) * 1000.0 if buckets.get(math.inf, 0.0) > 0 else None
    codes = {c: n - before.by_code.get(c, 0.0) for c, n in after.by_code.items()}
    requests, errors = round(sum(codes.values())), round(sum(n for c, n in codes.items() if c.startswith("5")))
    why = []
    if rows < plan.min_rows:
        why.append(f"only {rows} rows compared (at least {plan.min_rows} needed)")
    elif rate is not None and rate < plan.min_agreement:
        why.append(f"agreement {rate:.4f} is below {plan.min_agreement:g}")
    if errors:
        why.append(f"{errors} of the candidate's {requests} answers were 5xx")
    if plan.slo_p99_ms is not None and p99 is not None and p99 > plan.slo_p99_ms:
        why.append(f"the candidate's p99 {p99:.1f} ms is over the SLO's {plan.slo_p99_ms:g} ms")
    verdict = "held" if not why else "rolled back: " + "; ".join(why)
    return Step(name, route, round(seconds, 1), rows, rate, requests, errors, p99, verdict)


def rollout(
    plan: RolloutPlan, admin: ServiceAdmin, metrics_url: str, log: Callable[[str], None] = print
) -> RolloutResult:
    """Run the plan; the route is left with the candidate answering the incumbent's share (promoted), or as it was
    (rolled back). RolloutError if the service refuses a change."""
    original = admin.route(plan.route)
    incumbent = max(original["targets"], key=lambda t: original["targets"][t])
    if plan.candidate in original["targets"]:
        raise RolloutError(f"{plan.candidate!r} is already a target of route {plan.route!r}")
    log(f"rollout: {plan.candidate} on route {plan.route} (incumbent {incumbent}): loading it")
    admin.load(plan.candidate)
    steps: list[Step] = []
    with httpx.Client(timeout=30) as client:
        for pct in (None, *plan.steps_pct):
            name = "shadow" if pct is None else f"{pct:g}%"
            route = step_route(original, incumbent, plan.candidate, pct)
            admin.set_route(plan.route, route)
            before, start = _read(client, metrics_url, plan.route, plan.candidate), time.monotonic()
            step = _hold(plan, client, metrics_url, before, name, route, start)
            steps.append(step)
            log(f"rollout: step {name}: {_describe(step)}")
            if step.verdict != "held":
                admin.set_route(plan.route, original)
                log(f"rollout: route {plan.route} set back as it was; {incumbent} answers")
                return RolloutResult(plan.route, incumbent, plan.candidate, False, steps)
    final = {"targets": {**step_route(original, incumbent, plan.candidate, 100.0)["targets"]}, "shadow": None}
    final["targets"].pop(incumbent)
    admin.set_route(plan.route, final)
    log(f"rollout: {plan.candidate} answers route {plan.route}; {incumbent} is no longer a target (still loaded)")
    return RolloutResult(plan.route, incumbent, plan.candidate, True, steps)


def _hold(
    plan: RolloutPlan, client: httpx.Client, url: str, before: _Reading, name: str, route: dict, start: float
) -> Step:
    """Hold a step for plan.hold_s, longer (up to 4 x) until enough rows were compared; judge it."""
    while True:
        time.sleep(POLL_S)
        elapsed = time.monotonic() - start
        if elapsed < plan.hold_s:
            continue
        after = _read(client, url, plan.route, plan.candidate)
        step = judge(plan, before, after, name, route, elapsed)
        if step.rows >= plan.min_rows or elapsed >= 4 * plan.hold_s:
            return step


def _describe(step: Step) -> str:
    rate = "n/a" if step.agreement is None else f"{step.agreement:.4f}"
    p99 = "n/a" if step.p99_ms is None else f"{step.p99_ms:.1f} ms"
    return (
        f"{step.seconds:.0f} s, {step.rows} rows compared, agreement {rate}, candidate p99 {p99}, "
        f"{step.requests} answers ({step.errors} 5xx): {step.verdict}"
    )
