"""The load tester on routes: the listing's routes, the head configuration of a route, which model each answer says
answered (all protocols, answers made by the service's own encoders), the share per target, and the report; then
end to end against the real service with a 90/10 route and a shadow."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from loadtest.binary import HEADER_NAME
from loadtest.compare import compare
from loadtest.compare import markdown as compare_markdown
from loadtest.discovery import (
    DiscoveryError,
    ModelInfo,
    Route,
    parse_route,
    parse_routes,
    route_model,
    select_models,
)
from loadtest.http_client import Response
from loadtest.progress import Progress
from loadtest.report import CSV_COLUMNS, build_report, load_report, write_report
from loadtest.routes import ANSWERED_BY, UNNAMED, summary
from loadtest.runner import Level, Recorder, Target
from loadtest.stats import LevelResult
from loadtest.workload import request_body

H8 = ModelInfo("mha-h8-d512", 8, 64, 512, 4, 128, "cpu")
H4 = ModelInfo("mha-h4-d512", 4, 128, 512, 4, 64, "cpu")
H2 = ModelInfo("mha-h2-d512", 2, 256, 512, 4, 128, "cpu")
ENTRY = {
    "name": "classifier",
    "targets": {"mha-h8-d512": 90.0, "mha-h4-d512": 10.0},
    "shadow": {"model": "mha-h2-d512", "fraction": 0.2},
    "ready": True,
}
ROUTE = parse_route(ENTRY)


def test_a_route_entry_gives_its_weights_in_order_its_shadow_and_readiness():
    assert parse_route(ENTRY) == Route(
        "classifier", (("mha-h8-d512", 90.0), ("mha-h4-d512", 10.0)), "mha-h2-d512", 0.2, True
    )
    plain = parse_route(ENTRY | {"shadow": None, "ready": False, "targets": {"mha-h8-d512": 1, "mha-h4-d512": 0}})
    assert (plain.shadow, plain.shadow_fraction, plain.ready) == ("", 0.0, False)
    assert plain.weights() == {"mha-h8-d512": 1.0, "mha-h4-d512": 0.0}


def test_a_listing_from_before_routes_has_none():
    assert parse_routes({"models": []}) == ()
    assert parse_routes([]) == ()  # a bare list of models
    assert parse_routes({"models": [], "routes": [ENTRY]}) == (ROUTE,)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"targets": {"a": 1}}, "a route in the service's listing has no name"),
        (ENTRY | {"targets": {}}, "route 'classifier' in the service's listing has no targets"),
        (ENTRY | {"targets": {"a": -1, "b": 2}}, "targets must map model names to weights >= 0, not all 0"),
        (ENTRY | {"targets": {"a": 0}}, "targets must map model names to weights >= 0, not all 0"),
        (ENTRY | {"targets": {"a": "90"}}, "targets must map model names to weights >= 0"),
        (ENTRY | {"shadow": {"model": "m"}}, "has a shadow without model and fraction"),
    ],
)
def test_a_malformed_route_entry_is_named_in_one_line(entry, message):
    with pytest.raises(DiscoveryError, match=re.escape(message)):
        parse_route(entry)
    with pytest.raises(DiscoveryError, match="not a list of routes"):
        parse_routes({"models": [], "routes": {"classifier": ENTRY}})


def test_a_routes_head_configuration_is_its_targets_one_value_where_they_agree():
    model = route_model(ROUTE, [H8, H4, H2])
    assert (model.name, model.heads, model.head_dim, model.d_model, model.layers) == (
        "classifier",
        "8|4",
        "64|128",
        512,
        4,
    )
    assert (model.precision, model.backend, model.max_len) == ("fp32", "cpu", 64)  # texts must fit every target
    assert model.measurable and model.route == ROUTE
    assert model.to_json()["route"] == {
        "targets": {"mha-h8-d512": 90.0, "mha-h4-d512": 10.0},
        "shadow": {"model": "mha-h2-d512", "fraction": 0.2},
    }
    assert "route" not in H8.to_json()
    loading = ModelInfo("mha-h4-d512", 0, 0, 0, 0, 0, ready=False)
    half = route_model(ROUTE, [H8, loading])
    assert (half.heads, half.max_len, half.measurable) == ("8|?", 128, True)
    assert not route_model(ROUTE, [H2]).measurable  # no target known: nothing to size the texts by


def test_routes_are_selected_by_name_beside_models_and_all_means_every_model():
    models = [H8, H4, H2]
    assert [m.name for m in select_models(models, "all", (ROUTE,))] == ["mha-h2-d512", "mha-h4-d512", "mha-h8-d512"]
    chosen = select_models(models, "classifier,mha-h2-d512", (ROUTE,))
    assert [(m.name, m.heads, m.route is not None) for m in chosen] == [
        ("classifier", "8|4", True),
        ("mha-h2-d512", 2, False),
    ]
    with pytest.raises(DiscoveryError) as caught:
        select_models(models, "clasifier", (ROUTE,))
    assert str(caught.value) == (
        "unknown model(s) clasifier; the service serves: mha-h2-d512, mha-h4-d512, mha-h8-d512; routes: classifier"
    )


def _v2_request(protocol: str):
    from service.protocol import binary as server_binary
    from service.protocol.v2 import InferRequest

    body = request_body(protocol, ["a fine film", "a dull one"])
    if protocol == "v2":
        return InferRequest.model_validate_json(body.content)
    header, blob = server_binary.split(body.content, dict(body.headers)[HEADER_NAME])
    request = InferRequest.model_validate_json(header)
    server_binary.attach(request, blob)
    return request


def service_answer(protocol: str, model: str) -> Response:
    """The service's own answer from `model` under `protocol`, as the load tester's clients read it."""
    from service.protocol import binary as server_binary
    from service.protocol import v2
    from service.rpc import tensors

    logits = np.arange(4, dtype=np.float32).reshape(2, 2)  # (B, C)
    if protocol == "simple":  # the simple answer's fields in the service's order (service/protocol/simple.py)
        answer = {"model": model, "config": {"heads": 8, "d_model": 512}, "logits": logits.tolist()}
        return Response(200, json.dumps(answer).encode())
    if protocol == "v2":
        return Response(200, json.dumps(v2.infer_response(model, _v2_request("v2"), logits)).encode())
    if protocol == "v2-binary":
        header, raw = server_binary.infer_response(model, _v2_request("v2-binary"), logits)
        return Response(200, header + raw, {HEADER_NAME.lower(): str(len(header))})
    message = tensors.to_response(model, _v2_request("v2"), logits)
    return Response(200, message.SerializeToString())


@pytest.mark.parametrize("protocol", ["simple", "v2", "v2-binary", "grpc"])
def test_each_protocols_answer_names_the_model_that_answered(protocol):
    assert ANSWERED_BY[protocol](service_answer(protocol, "mha-h4-d512")) == "mha-h4-d512"
    assert ANSWERED_BY[protocol](Response(200, b"\xff not an answer")) == ""


def route_target(protocol: str = "simple") -> Target:
    model = route_model(ROUTE, [H8, H4, H2])
    return Target(model, "/v1/models/classifier/predict", (), 1, protocol, answered_by=ANSWERED_BY[protocol])


def test_answers_are_counted_per_model_and_shares_put_beside_the_weights():
    rec = Recorder(60.0, 1000, asyncio.Event())
    for answered_by in ["mha-h8-d512"] * 7 + ["mha-h4-d512"] * 2 + [""]:
        assert rec.take()
        rec.record(0.01, "", "", 1, answered_by)
    rec.take()
    rec.record(0.01, "503", "over capacity", 1)  # a failed request is nobody's answer
    rec.finish()
    result = rec.result(route_target(), Level("closed", 4))
    assert result.is_route and result.targets == {"mha-h8-d512": 90.0, "mha-h4-d512": 10.0}
    assert result.answered_by == {"mha-h8-d512": 7, "mha-h4-d512": 2, UNNAMED: 1}
    assert result.shares == {"mha-h8-d512": 0.7, "mha-h4-d512": 0.2, UNNAMED: 0.1}
    assert result.weight_shares == {"mha-h8-d512": 0.9, "mha-h4-d512": 0.1}
    assert (result.heads, result.head_dim, result.d_model) == ("8|4", "64|128", 512)


def route_level(protocol: str, c: int, answers: dict[str, int], shadow: dict | None = None) -> LevelResult:
    ok = sum(answers.values())
    return LevelResult(
        model="classifier",
        heads="8|4",
        head_dim="64|128",
        d_model=512,
        mode="closed",
        concurrency=c,
        offered_rate=0.0,
        batch_size=1,
        duration_s=2.0,
        sent=ok,
        ok=ok,
        throughput_rps=ok / 2,
        sequences_per_s=ok / 2,
        latency_ms={"p50": 5.0, "p90": 6.0, "p95": 7.0, "p99": 9.0, "max": 12.0, "mean": 5.5},
        protocol=protocol,
        targets={"mha-h8-d512": 90.0, "mha-h4-d512": 10.0},
        answered_by=answers,
        shadow=shadow or {},
    )


SHADOW = {
    "model": "mha-h2-d512",
    "fraction": 0.2,
    "requests": {"compared": 150, "dropped": 40, "preempted": 8, "failed": 2},
    "rows": 150,
    "agreeing_rows": 141,
    "agreement": 141 / 150,
    "max_abs_logit_diff": {"p50": 0.25, "p99": 2.5},
}
NO_SERIES = {"model": "mha-h2-d512", "fraction": 0.2, "note": "the service exports no ray_mha_shadow_requests_total"}
MODEL_LEVEL = LevelResult("mha-h8-d512", 8, 64, 512, "closed", 8, 0.0, 1, 2.0, 10, 10, latency_ms={"p50": 4.0})


def route_results() -> list[LevelResult]:
    return [
        MODEL_LEVEL,
        route_level("simple", 8, {"mha-h8-d512": 902, "mha-h4-d512": 98}, SHADOW),
        route_level("grpc", 8, {"mha-h8-d512": 450, "mha-h4-d512": 50}, NO_SERIES),
    ]


def test_the_report_shows_each_targets_share_beside_its_weight_and_the_agreement(tmp_path):
    results = route_results()
    write_report(tmp_path, build_report({"status": "complete"}, results, []), results, [])
    assert load_report(tmp_path)[1] == results  # the route fields round-trip through report.json
    level = json.loads((tmp_path / "report.json").read_text())["levels"][1]
    assert level["shares"] == {"mha-h8-d512": 0.902, "mha-h4-d512": 0.098} and level["heads"] == "8|4"

    with (tmp_path / "report.csv").open() as f:
        model_row, shadowed, unavailable = csv.DictReader(f)
    assert list(model_row) == CSV_COLUMNS and all(
        model_row[k] == "" for k in CSV_COLUMNS[CSV_COLUMNS.index("route_weights") :]
    )
    assert shadowed["heads"] == "8|4" and shadowed["route_weights"] == "mha-h8-d512:90;mha-h4-d512:10"
    assert shadowed["answered_by"] == "mha-h8-d512:902;mha-h4-d512:98"
    assert shadowed["shares"] == "mha-h8-d512:0.902;mha-h4-d512:0.098"
    assert (shadowed["shadow_model"], shadowed["shadow_compared"], shadowed["shadow_dropped"]) == (
        "mha-h2-d512",
        "150",
        "40",
    )
    assert float(shadowed["agreement_rate"]) == 141 / 150 and shadowed["max_abs_logit_diff_p99"] == "2.5"
    assert unavailable["shadow_model"] == "mha-h2-d512"
    assert {unavailable[k] for k in ("shadow_rows", "agreement_rate", "shadow_compared")} == {"n/a"}

    md = (tmp_path / "report.md").read_text()
    assert "| classifier | 8\\|4 | fp32 | 64\\|128 | simple | c=8 |" in md  # "8|4" is one cell
    shares = md.split("## Routes")[1].split("##")[0]
    assert "| classifier | simple | c=8 | 1000 | mha-h8-d512 | 90.00 | 90.20 | 902 |" in shares
    assert "| classifier | simple | c=8 | 1000 | mha-h4-d512 | 10.00 | 9.80 | 98 |" in shares
    agreement = md.split("## Shadow agreement")[1]
    assert (
        "| classifier | simple | c=8 | mha-h2-d512 | 150 | 40 | 8 | 2 | 150 | 141 | 94.00 | 0.25 | 2.50 | - |"
        in agreement
    )
    assert (
        "| classifier | grpc | c=8 | mha-h2-d512 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in agreement
    )


def test_a_report_without_routes_has_no_route_sections(tmp_path):
    write_report(tmp_path, build_report({"status": "complete"}, [MODEL_LEVEL], []), [MODEL_LEVEL], [])
    md = (tmp_path / "report.md").read_text()
    assert "## Routes" not in md and "## Shadow agreement" not in md


def test_the_console_line_gives_shares_beside_weights_and_the_agreement(tmp_path):
    with_shadow, without = route_results()[1:]
    assert summary(with_shadow) == (
        "shares mha-h8-d512 90.2% (weight 90.0%), mha-h4-d512 9.8% (weight 10.0%); "
        "shadow mha-h2-d512: agreement 94.0% of 150 rows (150 mirrored requests compared)"
    )
    assert summary(without).endswith(
        "; shadow mha-h2-d512: agreement n/a (the service exports no ray_mha_shadow_requests_total)"
    )
    plain = route_level("v2", 1, {"mha-h8-d512": 3, "mha-h2-d512": 1})
    assert (
        summary(plain)
        == "shares mha-h8-d512 75.0% (weight 90.0%), mha-h4-d512 0.0% (weight 10.0%), mha-h2-d512 25.0% (not a target)"
    )
    with (tmp_path / "progress.txt").open("w+") as stream:
        Progress(stream).done("classifier c=8", with_shadow)
        stream.seek(0)
        assert stream.read().rstrip("\n").endswith(summary(with_shadow))


def test_compare_shows_agreement_where_either_report_has_it_and_reads_reports_from_before_routes():
    before = [MODEL_LEVEL, route_level("simple", 8, {"mha-h8-d512": 900, "mha-h4-d512": 100})]  # no shadow yet
    rows, only = compare(before, route_results())
    assert only == ["only in B: classifier grpc c=8"]
    assert "agreement" not in rows[0].values and rows[1].values["agreement"][1] == pytest.approx(0.94)
    text = compare_markdown(rows, only, "a", "b")
    assert "| A agreement % | B agreement % | agreement B/A |" in text
    assert "| classifier | 8\\|4 | fp32 | simple | c=8 |" in text and "| - | 94.0 | - |" in text
    rows, _ = compare([MODEL_LEVEL], [MODEL_LEVEL])
    assert "agreement" not in compare_markdown(rows, [], "a", "b")


# ---- end to end: the real service with a route (service/routes.py) ----

ROOT = Path(__file__).resolve().parents[1]
APP = "loadtest-routes"
ROUTE_NAME = "classifier"
PRIMARY, MINOR = "mha-h4-d32", "mha-h2-d32"
SHADOW_MODEL = MINOR  # the answers of PRIMARY (90 %) are mirrored to it; its own are not
PROTOCOLS = ("simple", "grpc")  # each protocol's answer is read in the unit tests above; two run end to end
REQUESTS_PER_PROTOCOL = 500


@pytest.fixture(scope="module")
def route_app(serve_port, tiny_models_dir):
    from ray import serve
    from serving import deploy

    from service.local.ports import free_port

    routes = {ROUTE_NAME: {"targets": {PRIMARY: 90, MINOR: 10}, "shadow": {"model": SHADOW_MODEL, "fraction": 0.5}}}
    served = deploy(serve_port, APP, tiny_models_dir, ingress={"grpc_port": free_port()}, routes=routes)
    yield served
    serve.delete(APP)


def shadow_counts(metrics_url: str) -> tuple[float, float]:
    """(rows, agreeing rows) of the route's shadow as the service exported them, summed over every series."""
    rows = agreeing = 0.0
    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        name = line.split("{", 1)[0]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if (
            name == "ray_mha_shadow_rows_total"
            and labels.get("application") == APP
            and labels.get("route") == ROUTE_NAME
        ):
            rows += float(line.rsplit(" ", 1)[1])
            agreeing += float(line.rsplit(" ", 1)[1]) if labels.get("agreed") == "true" else 0.0
    return rows, agreeing


def settled_shadow_counts(metrics_url: str, still_s: float = 3.0, timeout_s: float = 60.0) -> tuple[float, float]:
    """The shadow counts once they stood still for `still_s` (Ray exports every second here)."""
    last, since, deadline = shadow_counts(metrics_url), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < still_s and time.monotonic() < deadline:
        time.sleep(0.5)
        now = shadow_counts(metrics_url)
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.serve
@pytest.mark.slow
def test_loadtest_reports_route_shares_and_agreement(route_app, tmp_path):
    import ray

    metrics_url = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    rows_before, agreeing_before = settled_shadow_counts(metrics_url)
    command = [sys.executable, "-m", "service.cli", "loadtest", "--quiet", "--url", route_app.base_url]
    command += ["--models", ROUTE_NAME, "--protocol", ",".join(PROTOCOLS), "--grpc-url", route_app.grpc_url]
    command += ["--concurrency", "4", "--rate", "", "--duration", "120", "--max-requests", str(REQUESTS_PER_PROTOCOL)]
    command += ["--warmup", "0", "--metrics-url", metrics_url, "--metrics-match", f"application={APP}"]
    command += ["--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "complete" and report["models"][0]["route"]["targets"] == {PRIMARY: 90.0, MINOR: 10.0}
    levels = report["levels"]
    assert [(r["model"], r["protocol"]) for r in levels] == [(ROUTE_NAME, p) for p in PROTOCOLS]
    for r in levels:  # every protocol's answers name a target: the counts add up to the successes
        assert r["ok"] == r["sent"] == REQUESTS_PER_PROTOCOL and set(r["answered_by"]) <= {PRIMARY, MINOR}, r
        assert sum(r["answered_by"].values()) == r["ok"] and r["heads"] == "4|2"
    answers = sum(r["ok"] for r in levels)
    primary_share = sum(r["answered_by"].get(PRIMARY, 0) for r in levels) / answers
    # 90/10: 1,000 answers, sd 0.95 points; within 3.5 (3.7 sd). The 2-point bar over 10,000: benchmarks/routes.py
    assert 0.865 <= primary_share <= 0.935, primary_share

    # the agreement the report gives is the service's own: agreeing rows / rows during the run, from /metrics
    rows_after, agreeing_after = settled_shadow_counts(metrics_url)
    rows = sum(r["shadow"]["rows"] for r in levels)
    agreeing = sum(r["shadow"]["agreeing_rows"] for r in levels)
    assert (rows, agreeing) == (rows_after - rows_before, agreeing_after - agreeing_before) and rows > 0
    for r in levels:
        assert r["shadow"]["agreement"] == (
            r["shadow"]["agreeing_rows"] / r["shadow"]["rows"] if r["shadow"]["rows"] else None
        )
        assert sum(r["shadow"]["requests"].values()) > 0 and r["shadow"]["model"] == SHADOW_MODEL
    assert f"{ROUTE_NAME} simple c=4: shares {PRIMARY}" in run.stdout
    md = (tmp_path / "report.md").read_text()
    assert "## Routes" in md and "## Shadow agreement" in md
