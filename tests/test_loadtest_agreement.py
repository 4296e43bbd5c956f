"""A route's shadow agreement from hand-made Prometheus text (the series service/metrics.py exports): counters summed
over replicas and primaries, deltas between two scrapes, n/a without the series; and the wait for the counters to
settle, against a small real HTTP server whose counters move."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import httpx
import pytest
from loopback_http import http_server

from loadtest.agreement import ShadowMeter, read, shadow_report
from loadtest.discovery import Route
from loadtest.server_metrics import parse_counter, parse_histogram

ROUTE = Route("classifier", (("mha-h8-d512", 90.0), ("mha-h4-d512", 10.0)), "mha-h2-d512", 0.2)
DIFF_BOUNDS = [1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]
HEADS = {"mha-h8-d512": "8", "mha-h4-d512": "4", "mha-h2-d512": "2"}


def _labels(route: str, primary: str, replica: int, app: str = "mha") -> str:
    shadow = "mha-h2-d512"
    return (
        f'application="{app}",replica="r{replica}",route="{route}",primary="{primary}",'
        f'primary_heads="{HEADS[primary]}",shadow="{shadow}",shadow_heads="{HEADS[shadow]}"'
    )


def exposition(
    outcomes: dict[str, dict[str, int]],
    rows: dict[str, tuple[int, int]],
    diffs: list[float] = (),
    routed: int = 0,
    route: str = "classifier",
) -> str:
    """Prometheus text as Ray exports the shadow series: `outcomes` {primary: {outcome: n}}, `rows` {primary: (rows,
    agreeing)}, each split over two replicas; `diffs` the max |logit diff| per compared request; `routed` requests
    to the route."""
    lines = ["# TYPE ray_mha_shadow_requests_total counter"]
    for primary, counts in outcomes.items():
        for outcome, n in counts.items():
            for replica, part in enumerate((n // 2, n - n // 2)):
                lines.append(
                    f'ray_mha_shadow_requests_total{{{_labels(route, primary, replica)},outcome="{outcome}"}} {part}.0'
                )
    for primary, (n, agreeing) in rows.items():
        lines.append(f'ray_mha_shadow_rows_total{{{_labels(route, primary, 0)},agreed="true"}} {agreeing}.0')
        lines.append(f'ray_mha_shadow_rows_total{{{_labels(route, primary, 0)},agreed="false"}} {n - agreeing}.0')
    if diffs:
        for le in [*DIFF_BOUNDS, math.inf]:
            count = sum(1 for d in diffs if d <= le)
            le_text = "+Inf" if math.isinf(le) else str(le)
            labels = f'{_labels(route, "mha-h8-d512", 0)},le="{le_text}"'
            lines.append(f"ray_mha_shadow_max_abs_logit_diff_bucket{{{labels}}} {count}.0")
    if routed:
        labels = f'application="mha",route="{route}",model="mha-h8-d512",heads="8",code="200"'
        lines.append(f"ray_mha_route_requests_total{{{labels}}} {routed}.0")
    # another application's route of the same name: never counted with --metrics-match application=mha
    lines.append(f"ray_mha_shadow_rows_total{{{_labels(route, 'mha-h8-d512', 0, app='other')}}} 1000.0")
    return "\n".join(lines) + "\n"


MATCH = {"application": "mha"}


def test_counters_are_summed_over_replicas_and_primaries_per_route():
    text = exposition(
        {"mha-h8-d512": {"compared": 30, "dropped": 5}, "mha-h4-d512": {"compared": 3, "preempted": 1}},
        {"mha-h8-d512": (30, 28), "mha-h4-d512": (3, 2)},
        routed=400,
    ) + exposition({"mha-h8-d512": {"compared": 7}}, {"mha-h8-d512": (7, 0)}, route="other-route")
    counts = read(text, "classifier", MATCH)
    assert counts.outcomes == {"compared": 33, "dropped": 5, "preempted": 1}
    assert (counts.rows, counts.agreeing_rows, counts.route_requests) == (33, 30, 400)
    assert parse_counter(text, "ray_mha_shadow_rows_total", MATCH) == {"": 40.0}  # both routes
    assert parse_counter(text, "ray_mha_shadow_rows_total", MATCH | {"route": "classifier"}, by="primary") == {
        "mha-h8-d512": 30.0,
        "mha-h4-d512": 3.0,
    }
    assert read("", "classifier", MATCH).route_requests is None  # a service without the series


def test_agreement_is_agreeing_rows_over_rows_observed_between_two_scrapes():
    before = read(
        exposition({"mha-h8-d512": {"compared": 100}}, {"mha-h8-d512": (100, 50)}, [5.0] * 100), "classifier", MATCH
    )
    later = {"mha-h8-d512": {"compared": 180, "dropped": 7, "failed": 1}, "mha-h4-d512": {"compared": 20}}
    diffs = [5.0] * 100 + [0.02] * 95 + [2.0] * 5
    after = read(exposition(later, {"mha-h8-d512": (180, 127), "mha-h4-d512": (20, 19)}, diffs), "classifier", MATCH)
    out = shadow_report(ROUTE, before, after)
    assert out["model"] == "mha-h2-d512" and out["fraction"] == 0.2
    assert out["requests"] == {"compared": 100, "dropped": 7, "preempted": 0, "failed": 1}
    assert (out["rows"], out["agreeing_rows"], out["agreement"]) == (100, 96, 0.96)  # the 50 agreeing before: not ours
    p50, p99 = out["max_abs_logit_diff"]["p50"], out["max_abs_logit_diff"]["p99"]
    assert 0.01 <= p50 <= 0.03 and 1.0 <= p99 <= 3.0  # the earlier 5.0 differences are not counted


def test_a_service_without_shadow_series_gives_n_a_and_no_compared_rows_no_rate():
    empty = read("", "classifier", MATCH)
    out = shadow_report(ROUTE, empty, empty)
    assert (
        "rows" not in out and out["note"] == "the service exports no ray_mha_shadow_requests_total for route classifier"
    )
    dropped = read(exposition({"mha-h8-d512": {"dropped": 12}}, {}), "classifier", MATCH)
    out = shadow_report(ROUTE, empty, dropped)
    assert out["requests"]["dropped"] == 12 and out["rows"] == 0 and out["agreement"] is None
    assert "max_abs_logit_diff" not in out


def test_a_routes_latency_is_its_targets_series_counted_as_the_route():
    lines = [
        f'lat_bucket{{model="{m}",le="{le}"}} {n}.0'
        for m, n in (("mha-h8-d512", 9), ("mha-h4-d512", 1), ("mha-h2-d512", 4))
        for le in ("0.01", "+Inf")
    ]
    alias = {"mha-h8-d512": "classifier", "mha-h4-d512": "classifier"}
    hist = parse_histogram("\n".join(lines), "lat", alias=alias)
    assert hist.count("classifier") == 10 and hist.count("mha-h2-d512") == 4  # the shadow's are not the route's


class MovingMetrics:
    """A /metrics server whose route counter and shadow counters are set by the test while it runs."""

    def __init__(self) -> None:
        self.text = ""

    @contextmanager
    def serving(self) -> Iterator[str]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        with http_server(Handler) as port:
            yield f"http://127.0.0.1:{port}/metrics"


@pytest.fixture
def moving() -> Iterator[tuple[MovingMetrics, str]]:
    metrics = MovingMetrics()
    with metrics.serving() as url:
        yield metrics, url


def test_the_meter_waits_for_the_routes_requests_then_for_the_shadow_counters_to_stand_still(moving):
    metrics, url = moving
    notes: list[str] = []
    with httpx.Client() as client:
        meter = ShadowMeter(client, url, MATCH, wait_s=20.0, notes=notes)
        metrics.text = exposition({}, {}, routed=100)
        meter.start(ROUTE)
        steps = [  # what the service exports as the level's requests and mirrored work are counted
            exposition({}, {}, routed=150),
            exposition({"mha-h8-d512": {"compared": 10}}, {"mha-h8-d512": (10, 9)}, routed=160),
            exposition({"mha-h8-d512": {"compared": 12}}, {"mha-h8-d512": (12, 11)}, routed=160),
        ]

        def export() -> None:
            for text in steps:
                metrics.text = text
                stop.wait(0.6)

        stop = threading.Event()
        exporter = threading.Thread(target=export)
        exporter.start()
        try:
            counts = meter.settle(ROUTE, ok_since_start=60)
        finally:
            stop.set()
            exporter.join()
    assert counts is not None and (counts.route_requests, counts.rows, counts.agreeing_rows) == (160, 12, 11)
    assert notes == []


def test_the_meter_turns_off_with_a_note_when_the_service_never_counts_the_routes_requests(moving):
    _, url = moving  # serving no series at all
    notes: list[str] = []
    with httpx.Client() as client:
        meter = ShadowMeter(client, url, MATCH, wait_s=1.0, notes=notes)
        meter.start(ROUTE)
        assert meter.settle(ROUTE, ok_since_start=0) is not None  # nothing sent yet: nothing to wait for
        assert meter.settle(ROUTE, ok_since_start=5) is None
        assert meter.settle(ROUTE, ok_since_start=5) is None  # off from then on, without waiting again
    assert notes == [
        f"shadow agreement omitted: no ray_mha_route_requests_total counted 5 requests to classifier at {url}"
    ]
    assert meter.report(ROUTE, None, None)["note"].startswith("no ray_mha_route_requests_total counted 5 requests")
    with httpx.Client() as client:
        without_url = ShadowMeter(client, "", MATCH, 1.0, notes)
        assert without_url.settle(ROUTE, ok_since_start=5) is None
    assert (
        without_url.report(ROUTE, None, None)["note"] == "agreement needs --metrics-url (the service's Prometheus URL)"
    )
