"""The slow-heads benchmark's own bookkeeping (benchmarks/slow_heads/): how a slow connection's end is told
apart, how the probe's samples are split around the slow connections, and how each bar line is judged. The run
itself is `python -m benchmarks.slow_heads`; the server's behaviour is tests/test_slow_heads.py's."""

from __future__ import annotations

import math

import pytest

from benchmarks.slow_heads.clients import outcome
from benchmarks.slow_heads.verdict import phases, summarize, verdicts


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (b'HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n\r\n{"error": "..."}', "408"),
        (b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\n\r\n{}", "503"),
        (b"", "bare close"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "other"),
        (b"garbage", "other"),
    ],
)
def test_a_slow_heads_end_is_named_by_the_status_the_server_sent_before_closing(answer, expected):
    assert outcome(answer) == expected


def test_probe_samples_are_split_at_the_first_slow_connection_and_the_last_close():
    samples = [(0.0, 0.002), (1.0, None), (2.0, 0.004), (3.0, 0.2), (5.0, 0.001)]
    split = phases(samples, begin=1.5, end=4.0)
    assert [split[p]["requests"] for p in ("before", "during", "after")] == [2, 2, 1]
    assert split["before"]["failures"] == 1 and split["before"]["p50_ms"] == pytest.approx(2.0)
    assert split["during"]["max_ms"] == pytest.approx(200.0)


def test_a_phase_without_answers_has_no_latency_and_fails_the_probe_line():
    split = phases([(0.0, 0.001), (2.0, None)], begin=1.0, end=3.0)
    assert math.isnan(split["during"]["p99_ms"]) and split["during"]["failures"] == 1
    result = {"slow": summarize({"records": []}, 11.0), "probe": split, "fds": {"idle_max": 60, "after": 60}}
    assert verdicts(result) == {"closed in time": True, "probe p99 < 100 ms": False, "fds back to idle": True}


def test_a_connection_closed_late_left_open_or_never_opened_fails_the_closed_in_time_line():
    records = [("408", 0.0, 10.0), ("503", 0.0, 0.5), ("bare close", 0.0, 10.9), ("reset", 0.0, 3.0)]
    slow = summarize({"records": records}, 11.0)
    assert slow["closed_in_time"] == slow["n"] == 4
    probe = phases([(0.0, 0.001), (2.0, 0.001), (4.0, 0.001)], begin=1.0, end=3.0)
    for late in (("408", 0.0, 11.2), ("still open", 0.0, 20.0), ("connect failed", math.nan, math.nan)):
        slow = summarize({"records": [*records, late]}, 11.0)
        assert slow["closed_in_time"] == 4 and slow["n"] == 5
        result = {"slow": slow, "probe": probe, "fds": {"idle_max": 60, "after": 60}}
        assert verdicts(result) == {"closed in time": False, "probe p99 < 100 ms": True, "fds back to idle": True}


def test_descriptors_above_the_idle_range_fail_the_fds_line():
    probe = phases([(0.0, 0.001), (2.0, 0.001), (4.0, 0.001)], begin=1.0, end=3.0)
    result = {"slow": summarize({"records": []}, 11.0), "probe": probe, "fds": {"idle_max": 60, "after": 61}}
    assert verdicts(result)["fds back to idle"] is False
