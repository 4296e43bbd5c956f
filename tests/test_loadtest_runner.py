"""The load tester's bookkeeping for one phase: every bound stops sending, and the numbers follow from the samples."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadtest.discovery import ModelInfo
from loadtest.runner import ABORT_AFTER, Level, Recorder, Target

TARGET = Target(ModelInfo("mha-h2-d32", 2, 16, 32, 1, 32), "/v1/models/mha-h2-d32/predict", (), batch_size=2)


def recorder(duration_s: float = 60.0, max_requests: int = 1000) -> Recorder:
    return Recorder(duration_s, max_requests, asyncio.Event())


def test_the_request_bound_stops_sending():
    rec = recorder(max_requests=3)
    assert [rec.take() for _ in range(5)] == [True, True, True, False, False]
    assert rec.sent == 3 and rec.stopped_by == "max_requests"


def test_the_duration_bound_stops_sending_but_not_a_scheduled_late_arrival():
    rec = recorder(duration_s=0.0)
    assert rec.take(scheduled=True) and rec.sent == 1  # an open-loop arrival is measured from its schedule
    assert not rec.take() and rec.stopped_by == "duration"


def test_ctrl_c_stops_sending():
    rec = recorder()
    rec.stop.set()
    assert not rec.take() and rec.stopped_by == "interrupted"


def test_a_level_whose_first_requests_all_fail_is_aborted():
    rec = recorder()
    for _ in range(ABORT_AFTER):
        assert rec.take()
        rec.record(0.01, "503", "over capacity", 2)
    assert not rec.take()
    assert rec.stopped_by == f"aborted: the first {ABORT_AFTER} requests all failed (503: {ABORT_AFTER})"


def test_failures_after_a_success_do_not_abort():
    rec = recorder()
    rec.take()
    rec.record(0.01, "", "", 2)
    for _ in range(ABORT_AFTER + 5):
        rec.take()
        rec.record(0.01, "timeout", "ReadTimeout", 2)
    assert rec.take() and rec.stopped_by == ""


def test_the_result_carries_the_models_precision():
    model = ModelInfo("mha-h2-d32-int8", 2, 16, 32, 1, 32, precision="int8", quantized_from="mha-h2-d32")
    target = Target(model, "/v1/models/mha-h2-d32-int8/predict", (), batch_size=1)
    rec = recorder()
    rec.take()
    rec.record(0.01, "", "", 1)
    rec.finish()
    result = rec.result(target, Level("closed", 1))
    assert (result.model, result.heads, result.precision) == ("mha-h2-d32-int8", 2, "int8")
    assert rec.result(TARGET, Level("closed", 1)).precision == "fp32"


def test_the_result_counts_what_was_recorded_over_the_whole_duration():
    rec = recorder(duration_s=0.3)
    for latency in (0.010, 0.020, 0.030):
        rec.take()
        rec.record(latency, "", "", 2)
    rec.take()
    rec.record(0.5, "400", "bad request", 2)
    time.sleep(0.31)
    assert not rec.take()
    rec.finish()
    result = rec.result(TARGET, Level("closed", 4))
    assert (result.sent, result.ok, result.errors, result.error_examples) == (4, 3, {"400": 1}, {"400": "bad request"})
    assert result.duration_s == pytest.approx(0.3, abs=0.002)  # the whole --duration, answers came earlier
    assert result.throughput_rps == pytest.approx(3 / result.duration_s, rel=0.01)
    assert result.sequences_per_s == pytest.approx(2 * result.throughput_rps, rel=0.01)
    assert result.latency_ms["p50"] == pytest.approx(20.0) and result.latency_ms["max"] == pytest.approx(30.0)
    assert result.level == "c=4" and result.achieved_rate == pytest.approx(4 / result.duration_s, rel=0.01)
