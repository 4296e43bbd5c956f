"""Load tester statistics: percentiles agree with numpy; the Poisson schedule has the asked-for rate."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from loadtest.runner import poisson_schedule
from loadtest.stats import LevelResult, latency_summary, percentile, precision_rank


@pytest.mark.parametrize("size", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy_linear_interpolation(size):
    rng = np.random.default_rng(size)
    values = rng.lognormal(mean=1.0, sigma=0.8, size=size).tolist()
    for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_of_nothing_is_nan_and_q_outside_0_100_is_an_error():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"outside 0\.\.100"):
        percentile([1.0], 101)


def test_latency_summary_reports_milliseconds_against_numpy():
    rng = np.random.default_rng(0)
    seconds = rng.uniform(0.001, 0.05, size=500)
    summary = latency_summary(seconds.tolist())
    for q in (50, 90, 95, 99):
        assert summary[f"p{q}"] == pytest.approx(np.percentile(seconds * 1000, q), abs=1e-3)
    assert summary["max"] == pytest.approx(seconds.max() * 1000, abs=1e-3)
    assert summary["mean"] == pytest.approx(seconds.mean() * 1000, abs=1e-3)
    assert latency_summary([]) == {}


@pytest.mark.parametrize("rate", [5.0, 200.0, 3000.0])
def test_poisson_schedule_has_the_asked_mean_rate_and_exponential_gaps(rate):
    duration = 20_000 / rate  # about 20,000 arrivals expected
    times = poisson_schedule(rate, duration, 10**9, random.Random(1))
    expected = rate * duration
    assert abs(len(times) - expected) < 5 * math.sqrt(expected)  # Poisson count: sd = sqrt(mean)
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1
    assert all(0 < t < duration for t in times) and times == sorted(times)


def test_poisson_schedule_is_bounded_by_request_count_and_rejects_a_zero_rate():
    assert len(poisson_schedule(1000.0, 60.0, 25, random.Random(0))) == 25
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_schedule(0.0, 1.0, 10, random.Random(0))


def test_a_level_without_precision_reads_as_fp32_and_groups_by_h_then_precision():
    fields = {"model": "m", "heads": 4, "head_dim": 8, "d_model": 32, "mode": "closed", "concurrency": 1}
    fields |= {"offered_rate": 0.0, "batch_size": 1, "duration_s": 1.0, "sent": 1, "ok": 1}
    old = LevelResult.from_json(fields)
    int8 = LevelResult.from_json(fields | {"model": "m-int8", "precision": "int8"})
    assert old.precision == "fp32" and int8.precision == "int8"
    assert old.group_key < int8.group_key < LevelResult.from_json(fields | {"heads": 8}).group_key
    assert [precision_rank(p) for p in ("fp32", "fp16", "int8", "bf16")] == [0, 1, 2, 3]
