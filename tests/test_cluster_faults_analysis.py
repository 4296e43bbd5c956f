"""The cluster-faults benchmark's figures and bar (benchmarks/cluster_faults/analysis.py) on synthetic records of an
open loop at 10 requests/s: what counts as in flight, lost, explained by the fault or not, when the full rate is back,
the longest gap, and the CSV the load client writes; and which answers the load client retries
(benchmarks/cluster_faults/load.py, against an in-process transport); which faults the command line runs. The
faults themselves are `python -m benchmarks.cluster_faults`.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from benchmarks.cluster_faults.analysis import (
    HOLD_BINS,
    FaultSpan,
    Record,
    analyse,
    fault_lines,
    full_rate_back_s,
    full_shares,
    in_flight,
    longest_gap_s,
    read_records,
    steady_line,
    write_records,
)
from benchmarks.cluster_faults.load import Load, LoadPlan

RATE = 10.0
OK = ("200", 0.05, "200", 0.05, 1)  # first outcome, its latency, last outcome, latency to the last end, attempts


def open_loop(start: float, end: float, answer=lambda t: OK, first_i: int = 0) -> list[Record]:
    """A request every 1 / RATE s from `start` to `end`, each sent on time and answered as `answer(scheduled)` says."""
    out = []
    for k in range(round((end - start) * RATE)):
        t = start + k / RATE
        first, first_s, last, last_s, attempts = answer(t)
        out.append(Record(first_i + k, "a" if k % 2 else "b", t, t, t + first_s, first, t + last_s, last, attempts))
    return out


def span(at: float = 20.0, **changes) -> FaultSpan:
    fields = dict(
        name="replica", what="SIGKILL", start=10.0, at=at, observe_end=at + 30, quiet_until=60.0, end=60.0
    ) | {"recovered_s": 4.0, "problems": ()}
    return FaultSpan(**(fields | changes))


def test_in_flight_means_a_first_attempt_begun_at_or_before_the_instant_and_not_yet_ended():
    records = open_loop(0, 2, lambda t: ("200", 0.25, "200", 0.25, 1))  # 10/s, 250 ms each
    assert sorted(r.scheduled for r in in_flight(records, 1.0)) == pytest.approx([0.8, 0.9, 1.0])


def test_requests_in_flight_at_the_fault_may_be_lost_and_the_bar_still_passes():
    def answer(t):
        if 19.5 <= t <= 20.0:  # in flight on what died: 503 at 20.1 s, and lost even after the retries
            return ("503", 20.1 - t, "503", 20.8 - t, 3)
        if 20.0 < t < 22.0:  # sent after the fault: refused at first, answered on a retry
            return ("connect_error", 0.01, "200", 0.3, 2)
        return OK

    result = analyse(open_loop(10, 60, answer), span())
    assert (result.sent, result.in_flight) == (500, 6)
    assert (result.lost, result.lost_unexplained) == (6, 0)
    assert (result.failed_first, result.failed_first_unexplained, result.failed_after) == (25, 19, 19)
    assert result.first_failures == {"connect_error": 19, "503": 6} and result.lost_outcomes == {"503": 6}
    assert result.retried == 25
    assert result.back_s == 2.0  # the seconds due from 20 s and 21 s got no first-attempt 200
    lost_only_in_flight, back, healthy = fault_lines(result)
    assert lost_only_in_flight.ok and back.ok and healthy.ok


def test_a_request_lost_that_was_sent_after_the_fault_fails_the_bar():
    def answer(t):
        return ("503", 0.01, "503", 0.6, 3) if math.isclose(t, 25.0) else OK

    result = analyse(open_loop(10, 60, answer), span())
    assert (result.in_flight, result.lost, result.lost_unexplained) == (1, 1, 1)  # in flight: the one due at 20 s
    assert not fault_lines(result)[0].ok


def test_a_failure_before_the_fault_is_not_explained_by_it():
    def answer(t):
        return ("500", 0.01, "500", 0.5, 3) if math.isclose(t, 12.0) else OK

    result = analyse(open_loop(10, 60, answer), span())
    assert (result.lost_unexplained, result.failed_after) == (1, 0)


def test_full_rate_is_back_from_the_first_second_after_which_every_second_is_full():
    assert full_rate_back_s([1.0] * 5) == 0.0
    assert full_rate_back_s([0.0, 0.5, 1.0, 0.9, 1.0]) == 2.0
    assert full_rate_back_s([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]) == 5.0  # a later dip moves it
    assert full_rate_back_s([0.0, 1.0, 1.0]) is None  # fewer than HOLD_BINS full seconds at the end
    assert full_rate_back_s([1.0, float("nan"), 1.0, 1.0, 1.0]) == 2.0  # a second with nothing due is not full
    assert full_rate_back_s([]) is None and HOLD_BINS == 3


def test_a_backlog_answered_in_a_burst_does_not_pass_for_full_seconds():
    def answer(t):  # everything due in [20, 23) waits until 24 s, then all answered 200 at once
        return ("200", 24.0 - t, "200", 24.0 - t, 1) if 20 <= t < 23 else OK

    records = open_loop(10, 40, answer)
    shares = full_shares(records, 20.0, 40.0)
    assert shares[:3] == [0.0, 0.0, 0.0] and shares[3:] == [1.0] * 17
    assert analyse(records, span(quiet_until=40.0, end=40.0)).back_s == 3.0


def test_the_longest_gap_counts_from_the_fault_to_the_first_200_and_between_200s():
    def answer(t):
        return ("connect_error", 0.01, "connect_error", 0.7, 3) if 20 <= t < 25 else OK

    records = open_loop(10, 40, answer)
    assert longest_gap_s(records, 20.0, 40.0) == pytest.approx(5.05)  # from 20 s to the 200 of the one due at 25 s
    assert longest_gap_s([], 20.0, 40.0) == 20.0


def test_the_bar_wants_full_rate_back_within_15_s_and_nothing_left_broken():
    def answer(t):
        return ("503", 0.01, "200", 0.3, 2) if 20 <= t < 36 else OK

    slow = analyse(open_loop(10, 60, answer), span())
    assert slow.back_s == 16.0 and not fault_lines(slow)[1].ok
    broken = analyse(open_loop(10, 60), span(recovered_s=None, problems=("ingress: 1 replicas RUNNING on 1 nodes",)))
    assert broken.back_s == 0.0 and fault_lines(broken)[1].ok and not fault_lines(broken)[2].ok


def test_a_steady_span_passes_only_with_every_request_answered_at_the_full_rate():
    assert steady_line("after", open_loop(0, 10), 0.0, 10.0).ok
    one_failed = open_loop(0, 10, lambda t: ("503", 0.01, "200", 0.3, 2) if math.isclose(t, 5.0) else OK)
    assert not steady_line("after", one_failed, 0.0, 10.0).ok
    assert not steady_line("after", [], 0.0, 10.0).ok


def test_a_first_attempt_under_way_when_a_steady_span_ends_is_the_next_faults_not_the_spans():
    # the last request, sent at 9.9 s, fails at 10.2 s: the fault at 10 s cut it
    cut = open_loop(0, 10, lambda t: ("closed", 0.3, "200", 0.6, 2) if math.isclose(t, 9.9) else OK)
    assert steady_line("before", cut, 0.0, 10.0).ok
    assert not steady_line("before", cut, 0.0, 10.5).ok


def test_records_come_back_from_the_csv_as_they_were_written(tmp_path):
    records = open_loop(1000.25, 1001.25, lambda t: ("timeout", 10.0, "timeout", 10.0, 1))
    write_records(tmp_path / "requests.csv", records)
    again = read_records(tmp_path / "requests.csv")
    assert [(r.i, r.model, r.first, r.outcome, r.attempts) for r in again] == [
        (r.i, r.model, r.first, r.outcome, r.attempts) for r in records
    ]
    assert [r.first_end for r in again] == pytest.approx([r.first_end for r in records], abs=1e-6)


class StopAfter:
    """A stop event set once `n` requests were started."""

    def __init__(self, n: int) -> None:
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_the_load_client_retries_refused_connections_503s_and_a_way_ins_404_but_not_timeouts_or_the_services_404s(
    tmp_path,
):
    seen: dict[str, int] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        model = request.url.path.split("/")[3]
        seen[model] = seen.get(model, 0) + 1
        if model == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if model == "slow":
            raise httpx.ReadTimeout("no answer", request=request)
        if model == "busy" and seen[model] == 1:
            return httpx.Response(503)
        if model == "routing" and seen[model] == 1:  # HAProxy before it has its routes
            return httpx.Response(404, text="Path '/v1/models/routing/predict' not found.")
        if model == "missing":  # the service's own: JSON
            return httpx.Response(404, json={"error": "model 'missing' is not served"})
        return httpx.Response(200)

    models = ("refused", "busy", "slow", "missing", "routing")
    plan = LoadPlan("http://127.0.0.1:9", models, 1000.0, 1.0, 2, 0.001, time.monotonic(), tmp_path / "r.csv")

    async def run() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            load = Load(plan, client)
            await load.run(StopAfter(len(models)))
            return load.records

    got = {r.model: (r.first, r.outcome, r.attempts) for r in asyncio.run(run())}
    assert got == {
        "refused": ("connect_error", "connect_error", 3),
        "busy": ("503", "200", 2),
        "slow": ("timeout", "timeout", 1),
        "missing": ("404", "404", 1),
        "routing": ("404 not JSON", "200", 2),
    }


def test_the_haproxy_fault_runs_by_default_only_where_haproxy_is_the_way_in(capsys):
    from benchmarks.cluster_faults.cli import parse_args
    from benchmarks.cluster_faults.faults import FAULTS

    assert parse_args([]).faults == list(FAULTS)
    serve_proxy = ["--env", "RAY_SERVE_ENABLE_HA_PROXY=0"]
    assert parse_args(serve_proxy).faults == [f for f in FAULTS if f != "haproxy"]
    with pytest.raises(SystemExit) as refused:
        parse_args([*serve_proxy, "--faults", "proxy,haproxy"])
    assert refused.value.code == 2 and "needs Serve's HAProxy ingress" in capsys.readouterr().err
    assert "haproxy" not in parse_args(["--env", "RAY_SERVE_ENABLE_HA_PROXY=false"]).faults
