"""Generation metrics per head configuration, scraped by a real Prometheus from `mha-serving serve` serving two
decoders (co-located, then each in a deployment of its own): finished requests counted by finished_reason with their
end-to-end latency and queue time, exactly as sent; the running, waiting and KV cache usage gauges following an open
stream and its client's disconnect; a queue-full and a queue-timeout 503 counted as rejections; and every metric of
the dashboard's generation row there."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import export_tiny_decoder
from prometheus import GENERATION_ROW, PrometheusServer, dashboard_metric_names

from benchmarks.harness.server import ServerProcess

LM = "lm-h4-kv1-d32"  # the tiny decoder (context 64): the completions counted
LONG = "lm-h4-kv4-d64"  # 8 layers: a whole stream (8191 tokens) takes ~50 s on 2 cores, far past the checks
LONG_CONTEXT = 8192  # also generate.kv_cache_tokens: a LONG stream of the whole context fills the budget at its end
QUEUE_TIMEOUT_S = 5.0  # generate.queue_timeout_s: a request waiting behind the LONG stream gets its 503 by then
COMPLETIONS = 6  # to LM, each running to max_tokens (finished_reason "length")
MAX_TOKENS = 8
PROMPT = "def f(x):"
PROMPT_TOKENS = 1 + len(PROMPT)  # BOS, then a token per byte

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generation-metrics-models")
    export_tiny_decoder(out, 1, 64, seed=1, spread=False)
    export_tiny_decoder(out, 4, LONG_CONTEXT, seed=4, d_model=64, layers=8, spread=False)
    return out


@pytest.fixture(scope="module", params=["colocated", "deployment"])
def server(request, models_dir):
    """Once per placement: the engines in the ingress (the data plane sets their gauges) or in replicas of their
    own (each replica sets its engine's); names, labels and counts must not depend on it."""
    config = {
        "models_dir": str(models_dir),
        "backend": "cpu",
        "generate": {
            "kv_cache_tokens": LONG_CONTEXT,
            "threads": 1,
            "max_waiting": 1,  # one request waits behind a LONG stream; the next is refused at once
            "max_running": 1,  # the LONG stream holds the batch (its KV is charged as it grows, not reserved)
            "queue_timeout_s": QUEUE_TIMEOUT_S,
        },
        "overrides": {name: {"placement": request.param} for name in (LM, LONG)},
    }
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # Ray's export every second, as tests/serving.py
    with ServerProcess(config) as running:
        yield running


@pytest.fixture(scope="module")
def prom(server):
    with PrometheusServer(f"127.0.0.1:{server.metrics_port}", scrape_interval="1s") as running:
        yield running


def _by(result: list[dict], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"].get(k, "") for k in labels): float(r["value"][1]) for r in result}


def _long(max_tokens: int, stream: bool = False) -> dict:
    body = {"model": LONG, "prompt": [1], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return body | {"stream": stream}


def test_finished_requests_are_counted_by_finished_reason_with_their_end_to_end_latency_and_queue_time(server, prom):
    body = {"model": LM, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
        for _ in range(COMPLETIONS):
            answer = client.post("/openai/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["finish_reason"] == "length"
    selector = f'model="{LM}"'

    def counts(metric: str, *labels: str) -> dict[tuple[str, ...], float]:
        """`metric`'s samples summed by model, kv_heads and `labels`, once they add up to what was sent."""
        by = ("model", "kv_heads", *labels)
        query = f"sum by ({', '.join(by)}) ({metric}{{{selector}}})"
        return _by(prom.wait_for(query, lambda res: sum(_by(res).values()) >= COMPLETIONS, 60), *by)

    success = counts("ray_mha_request_success_total", "heads", "finished_reason")
    assert success == {(LM, "1", "4", "length"): COMPLETIONS}
    for metric in (
        "ray_mha_e2e_request_latency_seconds_count",
        "ray_mha_request_queue_time_seconds_count",
        "ray_mha_time_to_first_token_seconds_count",
    ):
        assert counts(metric) == {(LM, "1"): COMPLETIONS}, metric
    assert counts("ray_mha_generation_tokens_total") == {(LM, "1"): COMPLETIONS * MAX_TOKENS}
    assert counts("ray_mha_prompt_tokens_total") == {(LM, "1"): COMPLETIONS * PROMPT_TOKENS}
    e2e = prom.query(f"sum(ray_mha_e2e_request_latency_seconds_sum{{{selector}}})")
    queued = prom.query(f"sum(ray_mha_request_queue_time_seconds_sum{{{selector}}})")
    e2e_s, queued_s = (float(r[0]["value"][1]) / COMPLETIONS for r in (e2e, queued))
    assert 0 <= queued_s <= e2e_s < 30, (queued_s, e2e_s)  # Ray's _sum comes from bucket midpoints: rough


def test_the_gauges_follow_an_open_stream_to_its_disconnect_and_both_503s_of_a_full_queue_are_rejections(server, prom):
    """A LONG stream holds the running batch: one more request waits and times out (503), the next finds the
    queue full (503); the stream's client then goes away mid-stream, and running falls back to 0."""
    selector = f'model="{LONG}"'
    running = f"sum by (model, kv_heads) (ray_mha_num_requests_running{{{selector}}})"
    usage = f"max by (model, kv_heads) (ray_mha_kv_cache_usage_perc{{{selector}}})"
    base_url = f"http://127.0.0.1:{server.port}"
    with (
        httpx.Client(base_url=base_url, timeout=60) as client,
        ThreadPoolExecutor(1) as pool,
        client.stream("POST", "/openai/v1/completions", json=_long(LONG_CONTEXT - 1, stream=True)) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a line iterator dropped closes its connection
        next(lines)  # the first chunk: the sequence runs, holding the running batch
        seen = prom.wait_for(running, lambda res: _by(res, "kv_heads") == {("4",): 1}, 30)
        assert _by(seen, "model", "kv_heads") == {(LONG, "4"): 1}
        # the bytes its one row holds at a step's peak (past and present), a share of the budget's two full rows
        prom.wait_for(usage, lambda res: 0 < _by(res, "kv_heads").get(("4",), 0) <= 1, 30)
        held = f"max by (model, kv_heads) (ray_mha_kv_cache_bytes{{{selector}}})"
        prom.wait_for(held, lambda res: _by(res, "kv_heads").get(("4",), 0) > 0, 30)

        waiter = pool.submit(client.post, "/openai/v1/completions", json=_long(MAX_TOKENS))
        time.sleep(0.5)  # the waiter is queued: its request reaches the engine in milliseconds
        full = client.post("/openai/v1/completions", json=_long(MAX_TOKENS))
        timed_out = waiter.result()
        assert full.status_code == 503 and "over capacity" in full.text, full.text
        assert timed_out.status_code == 503 and "queue_timeout_s" in timed_out.text, timed_out.text
    # leaving the block closed the connection before the stream ended
    left = time.monotonic()
    prom.wait_for(running, lambda res: _by(res, "kv_heads") == {("4",): 0}, 15)
    prom.wait_for(usage, lambda res: _by(res, "kv_heads") == {("4",): 0}, 15)
    print(f"running seen at 0 {time.monotonic() - left:.1f} s after the disconnect")
    waited = prom.query(f"max_over_time(ray_mha_num_requests_waiting{{{selector}}}[5m])")
    assert _by(waited, "kv_heads") == {("4",): 1}  # the one that timed out, seen in some scrape

    def settles(query: str, labels: tuple[str, ...], expected: dict) -> None:
        """`query` by `labels` reaches `expected` (the counters' increments reach Prometheus a few seconds late)."""
        prom.wait_for(query, lambda res: _by(res, *labels) == expected, 30)

    settles(f"sum by (model) (ray_mha_rejected_requests_total{{{selector}}})", ("model",), {(LONG,): 2})
    codes = f"sum by (model, code) (ray_mha_requests_total{{{selector}}})"
    settles(codes, ("model", "code"), {(LONG, "503"): 2, (LONG, "499"): 1})
    # cut by its client (a "length" here: the LONG stream ended by itself before the disconnect, too fast a machine)
    success = f"sum by (finished_reason) (ray_mha_request_success_total{{{selector}}})"
    settles(success, ("finished_reason",), {("abort",): 1})
    for metric in ("ray_mha_e2e_request_latency_seconds_count", "ray_mha_request_queue_time_seconds_count"):
        settles(f"sum by (model) ({metric}{{{selector}}})", ("model",), {(LONG,): 1})  # the 503s never started


def test_every_metric_of_the_dashboards_generation_row_has_series_of_both_decoders(server, prom):
    """After the tests above: each decoder has had finished, cut and queued requests."""
    names = dashboard_metric_names(GENERATION_ROW)
    assert {"ray_mha_num_requests_waiting", "ray_mha_request_success_total"} <= names, names
    for name in sorted(names):
        query = f'count by (kv_heads) ({{__name__=~"{name}(_bucket)?"}})'
        present = prom.wait_for(query, lambda res: len(res) == 2, 30)
        assert {r["metric"]["kv_heads"] for r in present} == {"1", "4"}, name
