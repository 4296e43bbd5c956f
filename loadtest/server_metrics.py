"""Server-side numbers from the service's Prometheus text: a histogram's buckets per model, deltas, quantiles, and
counters summed by a label.

Tolerant by design: a missing metric or an unreachable metrics URL becomes a note in the report, not a failure.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import httpx

# Tried in order; the first with observations for the model is used: the service's end-to-end latency at its
# ingress (labelled by model), else Ray Serve's own processing latency of the model's deployment (named after it).
DEFAULT_METRICS = ("ray_mha_request_latency_seconds", "ray_serve_deployment_processing_latency_ms")
# A decoder's: time to first token is observed once per request, so it is the one whose count is waited for; the
# inter-token latency is read from the same scrapes.
GENERATION_METRICS = ("ray_mha_time_to_first_token_seconds",)
GENERATION_ALSO = ("ray_mha_inter_token_latency_seconds",)
# Observed at each request's last event, after its inter-token latencies: its count is waited for before those are
# read, since a stream's first token (the settled count) is exported before its last ones.
GENERATION_LAST = "ray_mha_e2e_request_latency_seconds"
IDLE_GRACE_FRACTION = 0.6  # of --metrics-wait: how long a preferred histogram without new data is waited for
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsError(RuntimeError):
    """The metrics URL cannot be read or does not hold the histogram."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts per model (summed over replicas and other labels): {model: {le: count}}."""

    buckets: dict[str, dict[float, float]]

    def count(self, model: str) -> float:
        return self.buckets.get(model, {}).get(math.inf, 0.0)


def _samples(text: str, name: str, match: dict[str, str] | None) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each `name` sample whose labels include `match`."""
    out = []
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if not sample or sample.group(1) != name:
            continue
        labels = dict(_LABEL.findall(sample.group(2) or ""))
        if match and any(labels.get(k) != v for k, v in match.items()):
            continue
        out.append((labels, float(sample.group(3))))
    return out


def parse_counter(text: str, name: str, match: dict[str, str] | None = None, by: str = "") -> dict[str, float]:
    """A counter's samples whose labels include `match`, summed per value of the label `by` (all under "" without
    one); {} when the exposition has no such series."""
    sums: dict[str, float] = {}
    for labels, value in _samples(text, name, match):
        key = labels.get(by, "") if by else ""
        sums[key] = sums.get(key, 0.0) + value
    return sums


def parse_histogram(
    text: str,
    name: str,
    match: dict[str, str] | None = None,
    model_label: str = "model",
    alias: dict[str, str] | None = None,
) -> Histogram:
    """The `<name>_bucket` series of a Prometheus exposition whose labels include `match`, grouped by `model_label`
    (else `deployment`, which Ray Serve sets to the model's name); a model in `alias` is counted as its alias (a
    route's targets as the route)."""
    buckets: dict[str, dict[float, float]] = {}
    for labels, value in _samples(text, f"{name}_bucket", match):
        model = labels.get(model_label) or labels.get("deployment")
        if model is None or "le" not in labels:
            continue
        model = (alias or {}).get(model, model)
        le = math.inf if labels["le"] in ("+Inf", "Inf") else float(labels["le"])
        per_model = buckets.setdefault(model, {})
        per_model[le] = per_model.get(le, 0.0) + value
    return Histogram(buckets)


def fetch(client: httpx.Client, url: str) -> str:
    """The Prometheus text at `url`; MetricsError when it cannot be read."""
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise MetricsError(f"cannot read metrics at {url}: {exc.__class__.__name__}: {exc}") from None
    if response.status_code != 200:
        raise MetricsError(f"metrics URL {url} answered {response.status_code}")
    return response.text


def scrape(
    client: httpx.Client,
    url: str,
    names: tuple[str, ...],
    match: dict[str, str],
    alias: dict[str, str] | None = None,
) -> dict[str, Histogram]:
    """One read of the metrics URL: each named histogram, restricted to series with the `match` labels."""
    text = fetch(client, url)
    return {name: parse_histogram(text, name, match, alias=alias) for name in names}


def delta(before: Histogram, after: Histogram, model: str) -> dict[float, float]:
    """Bucket counts observed between two scrapes, for one model."""
    old = before.buckets.get(model, {})
    return {le: count - old.get(le, 0.0) for le, count in after.buckets.get(model, {}).items()}


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """Quantile q (0..1) of cumulative buckets, interpolating linearly inside a bucket (as PromQL does).

    A quantile that falls in the +Inf bucket returns the highest finite bound.
    """
    bounds = sorted(buckets)
    total = buckets.get(math.inf, 0.0)
    if total <= 0 or not bounds:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower


def unit_scale(name: str) -> float:
    """Milliseconds per unit of the metric, read from its name (`_seconds` or `_s`: 1000; otherwise ms)."""
    return 1000.0 if name.endswith(("_seconds", "_s")) else 1.0


def server_percentiles(before: Histogram, after: Histogram, model: str, name: str) -> dict[str, object]:
    """Server-side count and p50/p90/p95/p99 (ms) for one model between two scrapes."""
    buckets = delta(before, after, model)
    count = buckets.get(math.inf, 0.0)
    if count <= 0:
        return {"note": f"no observations of {name} for model {model} during this level"}
    scale = unit_scale(name)
    out: dict[str, object] = {"metric": name, "count": int(count)}
    for q in (50, 90, 95, 99):
        out[f"p{q}"] = round(bucket_quantile(buckets, q / 100) * scale, 3)
    return out


def settled_name(
    hists: dict[str, Histogram], model: str, base: dict[str, float], target: dict[str, float], skip_idle: bool = True
) -> str:
    """The first histogram (in order) whose count for `model` reached its target; "" while one is still catching up.

    A histogram with no new observations since `base` is skipped (the service does not record it) only when
    `skip_idle`; until then it may simply not have been exported yet (Ray exports each process's metrics on its own
    schedule), so the preferred histogram is waited for.
    """
    for name, hist in hists.items():
        count = hist.count(model)
        if count >= target[name]:
            return name
        if count > base[name] or not skip_idle:
            return ""  # data for this one is still arriving (or may be): wait for it
    return ""


def wait_for_counts(
    client: httpx.Client,
    url: str,
    names: tuple[str, ...],
    match: dict[str, str],
    model: str,
    base: dict[str, float],
    new_observations: float,
    timeout_s: float,
    alias: dict[str, str] | None = None,
) -> tuple[dict[str, Histogram], str]:
    """Scrape until a histogram holds `new_observations` more for `model` than at `base` (metrics are exported with
    a delay) or the timeout passes; the scrape and the histogram's name ("" on timeout)."""
    target = {name: base.get(name, 0.0) + new_observations for name in names}
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        hists = scrape(client, url, names, match, alias)
        grace_over = time.monotonic() - start >= IDLE_GRACE_FRACTION * timeout_s
        name = settled_name(hists, model, {n: base.get(n, 0.0) for n in names}, target, skip_idle=grace_over)
        if name or time.monotonic() >= deadline:
            return hists, name
        time.sleep(0.5)
