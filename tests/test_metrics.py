"""Metrics per head configuration, scraped by a real Prometheus from the session Ray's metrics export port.

Traffic goes to an application of its own ("metrics"), so the counts checked are exactly what this test sent.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus import GENERATION_ROW, PROMETHEUS_YML, PrometheusServer, dashboard_metric_names
from serving import deploy

from service import generation_metrics, metrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "rules.yml"
K8S_RULES = ROOT / "deploy" / "k8s" / "base" / "prometheusrule.yaml"
APP = "metrics"
SEQUENTIAL = {"mha-h2-d32": 13, "mha-h4-d32": 7}  # requests sent one at a time (all succeed)
BURST = 12  # concurrent requests at the slow, tiny-queue mha-h4-d32 deployment: some are rejected (503)
GONE = 5  # requests to mha-h4-d32 whose client closes the connection before the answer: counted as 499, not 500
ROUTE = "pair"  # every request answered by mha-h2-d32 and mirrored to mha-h4-d32
ROUTES = {ROUTE: {"targets": {"mha-h2-d32": 1}, "shadow": {"model": "mha-h4-d32", "fraction": 1.0}}}
MIRRORED = 10  # route requests of MIRRORED_ROWS texts each, sent apart: each shadow run finds the ingress idle
MIRRORED_ROWS = 4


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does this)")
    return binary


def test_promtool_accepts_the_local_prometheus_config_and_rules():
    for args in (["check", "config", str(PROMETHEUS_YML)], ["check", "rules", str(RULES)]):
        result = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_local_rules_are_the_prometheusrule_groups_of_the_cluster():
    local = yaml.safe_load(RULES.read_text())["groups"]
    cluster = yaml.safe_load(K8S_RULES.read_text())["spec"]["groups"]
    assert local == cluster


def test_dashboard_queries_name_only_metrics_the_service_defines():
    source = Path(metrics.__file__).read_text() + Path(generation_metrics.__file__).read_text()
    defined = {f"ray_{n}" for n in re.findall(r'"(mha_[a-z0-9_]+)"', source)}
    names = dashboard_metric_names() | dashboard_metric_names(GENERATION_ROW)
    assert dashboard_metric_names(GENERATION_ROW), "the dashboard has no generation row"
    assert names, "the dashboard names no metric"
    assert names <= defined, f"dashboard names undefined metrics: {sorted(names - defined)}"


@pytest.fixture(scope="module", params=["colocated", "deployment"])
def metrics_app(request, serve_port, tiny_models_dir):
    """The metrics application, once per placement (metric names and labels must not depend on it)."""
    slow_and_small = {"num_cpus": 0.1, "max_ongoing_requests": 1, "max_queued_requests": 1, "batch_wait_timeout_s": 0.3}
    slow_and_small["placement"] = request.param
    app = f"{APP}-{request.param}"
    overrides = {"mha-h4-d32": slow_and_small}
    return deploy(serve_port, app, tiny_models_dir, placement=request.param, overrides=overrides, routes=ROUTES)


def send_sequential(base_url: str, sent: Counter) -> None:
    """Requests one at a time to each model (all must succeed), counted by (model, code) into `sent`."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for name, n in SEQUENTIAL.items():
            for i in range(n):
                r = client.post(f"/v1/models/{name}/predict", json={"text": f"request {i} to {name}"})
                assert r.status_code == 200, r.text
                sent[(name, "200")] += 1


def send_burst(base_url: str, sent: Counter) -> None:
    """BURST concurrent requests at the slow, tiny-queue deployment; codes counted into `sent`."""
    with httpx.Client(base_url=base_url, timeout=30) as client, ThreadPoolExecutor(BURST) as pool:

        def one(i: int) -> int:
            return client.post("/v1/models/mha-h4-d32/predict", json={"text": f"burst {i}"}).status_code

        for code in pool.map(one, range(BURST)):
            sent[("mha-h4-d32", str(code))] += 1


def send_and_leave(base_url: str, sent: Counter) -> None:
    """GONE requests to the slow mha-h4-d32, each closed by its client while its batch window is still open."""
    url = httpx.URL(base_url)
    body = json.dumps({"text": "never mind"}).encode()
    head = f"POST {url.path.rstrip('/')}/v1/models/mha-h4-d32/predict HTTP/1.1\r\nHost: {url.host}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    for _ in range(GONE):
        with socket.create_connection((url.host, url.port), timeout=10) as sock:
            sock.sendall(head.encode() + body)
            time.sleep(0.1)  # in the 0.3 s batch window: no answer yet
        time.sleep(0.5)  # the server notices the closed connection; the next one finds the queue empty
        sent[("mha-h4-d32", "499")] += 1


def send_mirrored(base_url: str) -> tuple[int, list[float]]:
    """MIRRORED route requests, then the same texts to the shadow model itself -> the rows whose predicted label
    agreed and each request's largest absolute logit difference, computed here from both answers."""
    agreeing, diffs = 0, []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        batches = [[f"mirrored {i}.{j}" for j in range(MIRRORED_ROWS)] for i in range(MIRRORED)]
        answered = []
        for texts in batches:
            r = client.post(f"/v1/models/{ROUTE}/predict", json={"texts": texts})
            assert r.status_code == 200 and r.json()["model"] == "mha-h2-d32", r.text
            answered.append(np.array(r.json()["logits"]))  # (MIRRORED_ROWS, C)
            time.sleep(0.2)  # the ingress is idle: the shadow runs now
        for texts, logits in zip(batches, answered, strict=True):
            r = client.post("/v1/models/mha-h4-d32/predict", json={"texts": texts})
            shadow = np.array(r.json()["logits"])  # (MIRRORED_ROWS, C)
            agreeing += int((logits.argmax(axis=1) == shadow.argmax(axis=1)).sum())
            diffs.append(float(np.abs(logits - shadow).max()))
    return agreeing, diffs


@pytest.mark.serve
def test_prometheus_sees_latency_percentiles_exact_counts_and_shadow_agreement_per_head_configuration(
    metrics_app, metrics_port
):
    selector = f'application="{metrics_app.name}"'
    with PrometheusServer(f"127.0.0.1:{metrics_port}") as prom:  # scraping before, during and after the traffic

        def counts(result) -> dict:
            return {(r["metric"]["model"], r["metric"]["code"]): int(float(r["value"][1])) for r in result}

        # Two phases, each waited for in Prometheus, so every series rises between scrapes (rate() needs that).
        counts_query = f"sum by (model, code) (ray_mha_requests_total{{{selector}}})"
        sent: Counter = Counter()
        send_sequential(metrics_app.base_url, sent)
        prom.wait_for(counts_query, lambda res: counts(res) == dict(sent), timeout_s=90)
        send_sequential(metrics_app.base_url, sent)
        send_burst(metrics_app.base_url, sent)
        send_and_leave(metrics_app.base_url, sent)
        assert sent[("mha-h4-d32", "503")] > 0, f"the burst was not rejected at all: {sent}"
        assert {code for _, code in sent} <= {"200", "499", "503"}, sent
        seen = prom.wait_for(counts_query, lambda res: counts(res) == dict(sent), timeout_s=90)
        assert counts(seen) == dict(sent)

        def finite_per_heads(result) -> bool:
            return len(result) == 2 and all(0 < float(r["value"][1]) < 10 for r in result)

        latency = f"rate(ray_mha_request_latency_seconds_bucket{{{selector}}}[1m])"
        for q in ("0.50", "0.99"):
            series = prom.wait_for(f"histogram_quantile({q}, sum by (le, heads) ({latency}))", finite_per_heads, 30)
            assert sorted(r["metric"]["heads"] for r in series) == ["2", "4"]

        rejected = prom.query(f"sum by (model, heads) (ray_mha_rejected_requests_total{{{selector}}})")
        assert [(r["metric"]["model"], r["metric"]["heads"], int(float(r["value"][1]))) for r in rejected] == [
            ("mha-h4-d32", "4", sent[("mha-h4-d32", "503")])
        ]
        batches = prom.wait_for(  # recorded in the model replicas, exported on their own schedule
            f"sum by (model) (ray_mha_batch_size_count{{{selector}}})",
            lambda res: {r["metric"]["model"] for r in res} == set(SEQUENTIAL),
            timeout_s=60,
        )
        rows = {r["metric"]["model"]: float(r["value"][1]) for r in batches}
        assert 0 < rows["mha-h2-d32"] <= sent[("mha-h2-d32", "200")], rows  # batches never outnumber requests

        # A route mirrored to a shadow: the agreement counted in the service is the agreement of the two answers.
        agreeing, diffs = send_mirrored(metrics_app.base_url)
        shadow = 'route="pair", primary="mha-h2-d32", primary_heads="2", shadow="mha-h4-d32", shadow_heads="4"'
        outcomes = prom.wait_for(
            f"sum by (outcome) (ray_mha_shadow_requests_total{{{selector}, {shadow}}})",
            lambda res: sum(float(r["value"][1]) for r in res) >= MIRRORED,
            timeout_s=60,
        )
        assert {r["metric"]["outcome"]: float(r["value"][1]) for r in outcomes} == {"compared": MIRRORED}

        def total(query: str) -> float:
            return sum(float(r["value"][1]) for r in prom.query(query))

        assert total(f"ray_mha_shadow_rows_total{{{selector}, {shadow}}}") == MIRRORED * MIRRORED_ROWS
        assert total(f'ray_mha_shadow_rows_total{{{selector}, {shadow}, agreed="true"}}') == agreeing
        buckets = prom.query(f"sum by (le) (ray_mha_shadow_max_abs_logit_diff_bucket{{{selector}, {shadow}}})")
        seen = {float(r["metric"]["le"]): float(r["value"][1]) for r in buckets}  # Ray's _sum is from bucket midpoints
        assert seen == {le: sum(d <= le for d in diffs) for le in [*metrics.LOGIT_DIFF_BUCKETS, float("inf")]}
        routed = prom.query(f"sum by (model, heads, code) (ray_mha_route_requests_total{{{selector}}})")
        assert [
            (r["metric"]["model"], r["metric"]["heads"], r["metric"]["code"], float(r["value"][1])) for r in routed
        ] == [("mha-h2-d32", "2", "200", MIRRORED)]

        info = prom.query(f"ray_mha_model_info{{{selector}}}")
        assert {(r["metric"]["model"], r["metric"]["head_dim"], r["metric"]["backend"]) for r in info} == {
            ("mha-h2-d32", "16", "cpu"),
            ("mha-h4-d32", "8", "cpu"),
        }
        for name in sorted(dashboard_metric_names()):
            present = prom.query(f'count({{__name__=~"{name}(_bucket)?", {selector}}})')
            assert present, f"dashboard metric {name} has no series after traffic"
