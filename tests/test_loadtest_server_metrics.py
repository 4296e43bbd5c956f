"""Server-side latency from Prometheus text: parsing histograms, deltas between scrapes, bucket quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.server_metrics import (
    Histogram,
    bucket_quantile,
    parse_histogram,
    server_percentiles,
    settled_name,
    unit_scale,
)

BOUNDS = [1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0]


def exposition(samples_by_model: dict[str, list[float]], name: str = "lat_ms", replicas: int = 2) -> str:
    """Prometheus text for a histogram of these samples, split across replicas (as Ray exports it)."""
    lines = [f"# HELP {name} latency", f"# TYPE {name} histogram", 'other_metric_bucket{le="1"} 99']
    for model, samples in samples_by_model.items():
        for replica in range(replicas):
            part = samples[replica::replicas]
            for le in [*BOUNDS, math.inf]:
                count = sum(1 for s in part if s <= le)
                le_text = "+Inf" if math.isinf(le) else str(le)
                labels = f'model="{model}",replica="r{replica}",note="a \\"quoted\\" value",le="{le_text}"'
                lines.append(f"{name}_bucket{{{labels}}} {float(count)}")
            lines.append(f'{name}_count{{model="{model}",replica="r{replica}"}} {float(len(part))}')
    return "\n".join(lines) + "\n"


def test_histogram_buckets_are_summed_over_replicas_per_model():
    samples = {"mha-h2-d32": [0.5, 3.0, 3.0, 7.0, 200.0], "mha-h4-d32": [1.5]}
    hist = parse_histogram(exposition(samples), "lat_ms")
    assert set(hist.buckets) == {"mha-h2-d32", "mha-h4-d32"}
    assert hist.count("mha-h2-d32") == 5 and hist.count("mha-h4-d32") == 1
    assert hist.buckets["mha-h2-d32"][5.0] == 3
    assert hist.count("absent") == 0
    assert parse_histogram(exposition(samples), "no_such_metric").buckets == {}


def test_bucket_quantile_interpolates_inside_the_bucket_like_promql():
    buckets = {1.0: 0.0, 2.0: 10.0, math.inf: 10.0}
    assert bucket_quantile(buckets, 0.5) == pytest.approx(1.5)
    assert bucket_quantile(buckets, 1.0) == pytest.approx(2.0)
    assert bucket_quantile({1.0: 2.0, math.inf: 4.0}, 0.9) == 1.0  # in the +Inf bucket: the highest finite bound
    assert math.isnan(bucket_quantile({math.inf: 0.0}, 0.5))


@pytest.mark.parametrize("q", [50, 90, 95, 99])
def test_bucket_quantiles_are_within_one_bucket_of_the_exact_percentile(q):
    samples = np.random.default_rng(q).uniform(0.0, 60.0, size=5000)
    hist = parse_histogram(exposition({"m": samples.tolist()}), "lat_ms")
    exact = float(np.percentile(samples, q))
    bounds = [0.0, *BOUNDS]
    lo = max(b for b in bounds if b <= exact)
    hi = min(b for b in [*BOUNDS, math.inf] if b >= exact)
    assert lo <= bucket_quantile(hist.buckets["m"], q / 100) <= hi


def test_server_percentiles_use_only_what_was_observed_between_two_scrapes():
    before = parse_histogram(exposition({"m": [90.0] * 100}), "lat_ms")  # slow requests before the level
    after = parse_histogram(exposition({"m": [90.0] * 100 + [1.5] * 40}), "lat_ms")
    out = server_percentiles(before, after, "m", "lat_ms")
    assert out["count"] == 40
    assert 1.0 <= out["p50"] <= 2.0 and 1.0 <= out["p99"] <= 2.0  # the earlier 90 ms requests are not counted
    assert "note" in server_percentiles(after, after, "m", "lat_ms")


def test_seconds_histograms_are_reported_in_milliseconds():
    assert unit_scale("x_seconds") == 1000.0 and unit_scale("x_ms") == 1.0
    before = Histogram({"m": {0.001: 0.0, 0.01: 0.0, math.inf: 0.0}})
    after = Histogram({"m": {0.001: 0.0, 0.01: 10.0, math.inf: 10.0}})
    out = server_percentiles(before, after, "m", "lat_seconds")
    assert 1.0 <= out["p50"] <= 10.0


def test_series_can_be_restricted_to_matching_labels():
    text = exposition({"m": [1.5, 1.5]}) + exposition({"m": [30.0]}).replace('model="m"', 'model="m",app="other"')
    assert parse_histogram(text, "lat_ms").count("m") == 3
    assert parse_histogram(text, "lat_ms", match={"app": "other"}).count("m") == 1
    assert parse_histogram(text, "lat_ms", match={"app": "absent"}).buckets == {}


def test_the_first_histogram_with_data_is_chosen_and_a_lagging_one_is_waited_for():
    def hists(first: float, second: float) -> dict[str, Histogram]:
        return {"ingress": Histogram({"m": {math.inf: first}}), "serve": Histogram({"m": {math.inf: second}})}

    base, target = {"ingress": 10.0, "serve": 50.0}, {"ingress": 20.0, "serve": 60.0}
    assert settled_name(hists(20, 60), "m", base, target) == "ingress"
    assert settled_name(hists(15, 60), "m", base, target) == ""  # ingress data still arriving: wait for it
    assert settled_name(hists(10, 60), "m", base, target) == "serve"  # ingress records nothing for m: skip it
    assert settled_name(hists(10, 55), "m", base, target) == ""
    # before the grace period is over, a preferred histogram without data may just not be exported yet
    assert settled_name(hists(10, 60), "m", base, target, skip_idle=False) == ""
    assert settled_name(hists(20, 60), "m", base, target, skip_idle=False) == "ingress"
