"""A route's shadow agreement from the service's Prometheus series, between a scrape before and one after a level:
mirrored requests by outcome, agreeing rows / rows, and quantiles of the largest |logit difference| per request.

Tolerant like the server-side percentiles: no metrics URL, or a service without these series, makes the columns
n/a with a note, never a failure.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import httpx

from loadtest import server_metrics
from loadtest.discovery import Route

ROUTE_REQUESTS = "ray_mha_route_requests_total"
SHADOW_REQUESTS = "ray_mha_shadow_requests_total"
SHADOW_ROWS = "ray_mha_shadow_rows_total"  # label agreed: "true" (same predicted label) or "false"
SHADOW_DIFF = "ray_mha_shadow_max_abs_logit_diff"
OUTCOMES = ("compared", "dropped", "preempted", "failed")
# Mirrored work may finish after the answer it mirrors, and Ray exports each process's series on its own schedule:
# once the route's counter has counted the level, the shadow's counters must stand still this long.
QUIET_S = 2.0


@dataclass(frozen=True)
class ShadowCounts:
    """One scrape of a route's series; None (or empty) where the service exports none (yet)."""

    route_requests: float | None
    outcomes: dict[str, float] = field(default_factory=dict)  # mirrored requests by outcome; {}: no series
    rows: float = 0.0
    agreeing_rows: float = 0.0
    diff_buckets: dict[float, float] = field(default_factory=dict)  # cumulative, of max |logit diff|

    @property
    def shadow_state(self) -> tuple[object, ...]:
        """What must stand still for the counts to be settled."""
        return tuple(sorted(self.outcomes.items())), self.rows, self.agreeing_rows


def read(text: str, route: str, match: dict[str, str]) -> ShadowCounts:
    """A route's series from a Prometheus exposition, restricted to series with the `match` labels."""
    match = match | {"route": route}
    requests = server_metrics.parse_counter(text, ROUTE_REQUESTS, match)
    diff = server_metrics.parse_histogram(text, SHADOW_DIFF, match, model_label="route")
    return ShadowCounts(
        route_requests=requests.get(""),
        outcomes=server_metrics.parse_counter(text, SHADOW_REQUESTS, match, by="outcome"),
        rows=server_metrics.parse_counter(text, SHADOW_ROWS, match).get("", 0.0),
        agreeing_rows=server_metrics.parse_counter(text, SHADOW_ROWS, match | {"agreed": "true"}).get("", 0.0),
        diff_buckets=diff.buckets.get(route, {}),
    )


def unavailable(route: Route, why: str) -> dict[str, object]:
    """The shadow's entry in a level's result when its agreement cannot be read: its columns say n/a."""
    return {"model": route.shadow, "fraction": route.shadow_fraction, "note": why}


def shadow_report(route: Route, before: ShadowCounts, after: ShadowCounts) -> dict[str, object]:
    """Mirrored requests by outcome, rows compared, agreeing rows and their rate, and the p50/p99 of max |logit
    diff| observed between two scrapes; n/a (a note) when the service exports no mirrored requests for the route."""
    if not after.outcomes:
        return unavailable(route, f"the service exports no {SHADOW_REQUESTS} for route {route.name}")
    outcomes = [*OUTCOMES, *sorted(set(after.outcomes) - set(OUTCOMES))]
    requests = {o: round(after.outcomes.get(o, 0.0) - before.outcomes.get(o, 0.0)) for o in outcomes}
    rows = round(after.rows - before.rows)
    agreeing = round(after.agreeing_rows - before.agreeing_rows)
    out: dict[str, object] = {"model": route.shadow, "fraction": route.shadow_fraction, "requests": requests}
    out |= {"rows": rows, "agreeing_rows": agreeing, "agreement": agreeing / rows if rows > 0 else None}
    old = before.diff_buckets
    buckets = {le: count - old.get(le, 0.0) for le, count in after.diff_buckets.items()}
    if buckets.get(math.inf, 0.0) > 0:
        quantiles = {f"p{q}": round(server_metrics.bucket_quantile(buckets, q / 100), 6) for q in (50, 99)}
        out["max_abs_logit_diff"] = quantiles
    return out


class ShadowMeter:
    """Scrapes a route's series around each level; turns itself off (with a note) when they cannot be read."""

    def __init__(self, client: httpx.Client, url: str, match: dict[str, str], wait_s: float, notes: list[str]):
        self.client = client
        self.url = url
        self.match = match
        self.wait_s = wait_s
        self.notes = notes
        self.off_because = "" if url else "agreement needs --metrics-url (the service's Prometheus URL)"
        self.base = 0.0

    def _off(self, why: str) -> None:
        self.off_because = why
        self.notes.append(f"shadow agreement omitted: {why}")

    def start(self, route: Route) -> None:
        """Note the route's request count before any of its load."""
        if not self.off_because:
            try:
                counts = read(server_metrics.fetch(self.client, self.url), route.name, self.match)
            except server_metrics.MetricsError as exc:
                return self._off(str(exc))
            self.base = counts.route_requests or 0.0

    def settle(self, route: Route, ok_since_start: int) -> ShadowCounts | None:
        """A scrape once the route's counter holds `ok_since_start` more requests than at `start` and the shadow's
        counters stand still (None when turned off)."""
        if self.off_because:
            return None
        deadline = time.monotonic() + self.wait_s
        quiet_s = min(QUIET_S, self.wait_s / 2)
        counted, still_since, state = False, 0.0, None
        while True:
            try:
                counts = read(server_metrics.fetch(self.client, self.url), route.name, self.match)
            except server_metrics.MetricsError as exc:
                return self._off(str(exc))
            now = time.monotonic()
            counted = counted or ok_since_start == 0 or (counts.route_requests or 0.0) >= self.base + ok_since_start
            if counts.shadow_state != state:
                still_since, state = now, counts.shadow_state
            if counted and now - still_since >= quiet_s:
                return counts
            if now >= deadline:
                if counted:
                    return counts  # still moving: what was exported by now
                return self._off(f"no {ROUTE_REQUESTS} counted {ok_since_start} requests to {route.name} at {self.url}")
            time.sleep(0.5)

    def report(self, route: Route, before: ShadowCounts | None, after: ShadowCounts | None) -> dict[str, object]:
        if before is None or after is None:
            return unavailable(route, self.off_because or "interrupted")
        return shadow_report(route, before, after)
