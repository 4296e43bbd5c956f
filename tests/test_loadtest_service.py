"""The load tester against the real service (two tiny models on the session's Ray Serve, gRPC in the ingress replica
on a port of its own), run as a user runs it.

Its application is its own (`/loadtest`), so the service's counters for it hold only the load tester's requests.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from service.local.ports import free_port

pytestmark = [pytest.mark.serve, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
APP = "loadtest"
MODELS = ("mha-h2-d32", "mha-h4-d32")


@pytest.fixture(scope="module")
def app(serve_port, tiny_models_dir):
    """The real application on the two tiny models under /loadtest with gRPC, in the session's Ray; deleted after."""
    from ray import serve
    from serving import deploy

    served = deploy(serve_port, APP, tiny_models_dir, ingress={"grpc_port": free_port()})
    yield served
    serve.delete(APP)


@pytest.fixture(scope="module")
def metrics_url(app) -> str:
    """The Prometheus exposition of the session's Ray (every replica's series, Serve's own included)."""
    import ray

    return f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"


def loadtest(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "service.cli", "loadtest", "--quiet", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def served_requests(metrics_url: str, endpoint: str = "v1_predict") -> Counter:
    """The service's own count of answered requests to `endpoint` per model of our application (not the load
    tester's)."""
    counts: Counter = Counter()
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("ray_mha_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("application") == APP and labels.get("endpoint") == endpoint and labels["code"] == "200":
                counts[labels["model"]] += float(line.rsplit(" ", 1)[1])
    return counts


def wait_for_counts(
    metrics_url: str, expected: dict[str, int], timeout_s: float = 40, endpoint: str = "v1_predict"
) -> Counter:
    """Ray exports metrics every few seconds: wait until every expected count is reached (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = served_requests(metrics_url, endpoint)
        if all(counts[m] >= n for m, n in expected.items()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


def test_report_numbers_match_what_the_service_counted(app, metrics_url, tmp_path):
    before = wait_for_counts(metrics_url, {})
    out = tmp_path / "report"
    run = loadtest(
        *("--url", app.base_url, "--concurrency", "4", "--rate", "20", "--duration", "2", "--warmup", "0.5"),
        *("--seq-len", "uniform:4:40", "--metrics-url", metrics_url, "--metrics-match", f"application={APP}"),
        *("--out", str(out)),
    )
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "complete" and report["notes"][0].endswith("clamped to 4..32 tokens (model max_len=32)")
    levels = report["levels"]
    assert [(r["model"], r["level"]) for r in levels] == [(m, lv) for m in MODELS for lv in ("c=4", "rate=20/s")]
    for r in levels:
        assert r["ok"] > 0 and r["errors"] == {} and r["ok"] == r["sent"], r
        assert r["throughput_rps"] == pytest.approx(r["ok"] / r["duration_s"], rel=1e-3)
        lat = r["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert r["warmup_ok"] > 0 and r["warmup_ok"] == r["warmup_sent"]
        # the report's server-side numbers: Serve's latency histogram of that model, observed during this level only
        assert r["server"]["count"] == r["ok"], r["server"]
        assert 0 < r["server"]["p50"] <= r["server"]["p99"]
        assert 2.0 <= r["duration_s"] < 2.0 + 30  # bounded by --duration (plus the answers still in flight)
    # an independent count: the service's request counter for each model, warm-up requests included
    expected = {m: sum(r["ok"] + r["warmup_ok"] for r in levels if r["model"] == m) for m in MODELS}
    after = wait_for_counts(metrics_url, {m: before[m] + n for m, n in expected.items()})
    assert {m: after[m] - before[m] for m in MODELS} == expected
    csv_lines = (out / "report.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(levels)
    md = (out / "report.md").read_text()
    assert all(f"| {m} |" in md for m in MODELS) and "server p99 ms" in md
    assert sorted(p.name for p in out.glob("*.png")) == [
        "latency_throughput.png",
        "latency_vs_heads.png",
        "throughput_vs_concurrency.png",
    ]


PROTOCOLS = ("v2", "v2-binary", "grpc")
ENDPOINTS = {"v2": "v2_infer", "v2-binary": "v2_infer", "grpc": "grpc_infer"}  # the service's label for each


def test_one_run_compares_http_json_http_binary_and_grpc_and_its_csv_agrees_with_its_json(app, metrics_url, tmp_path):
    model = MODELS[0]
    before = {e: wait_for_counts(metrics_url, {}, endpoint=e)[model] for e in set(ENDPOINTS.values())}
    run = loadtest(
        *("--url", app.base_url, "--models", model, "--protocol", ",".join(PROTOCOLS), "--grpc-url", app.grpc_url),
        *("--concurrency", "1,4", "--rate", "", "--duration", "1", "--warmup", "0.2", "--out", str(tmp_path)),
    )
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "complete" and report["protocol"] == ",".join(PROTOCOLS)
    levels = report["levels"]
    assert [(r["model"], r["level"], r["protocol"]) for r in levels] == [
        (model, lv, p) for lv in ("c=1", "c=4") for p in PROTOCOLS
    ]  # the protocols take turns at each level
    for r in levels:  # v2-binary's 200s are counted ok only when their binary logits are well formed
        assert r["ok"] > 0 and r["errors"] == {} and r["ok"] == r["sent"], r
    with (tmp_path / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [
        (row["protocol"], row["level"], int(row["ok"]), float(row["p50_ms"]), float(row["throughput_rps"]))
        for row in rows
    ] == [(r["protocol"], r["level"], r["ok"], r["latency_ms"]["p50"], r["throughput_rps"]) for r in levels]
    assert "## Per model and load level, protocols side by side" in (tmp_path / "report.md").read_text()
    # an independent count: the service's own, per endpoint (gRPC's calls came over gRPC), warm-ups included
    for endpoint in set(ENDPOINTS.values()):
        sent = sum(r["ok"] + r["warmup_ok"] for r in levels if ENDPOINTS[r["protocol"]] == endpoint)
        after = wait_for_counts(metrics_url, {model: before[endpoint] + sent}, endpoint=endpoint)
        assert after[model] - before[endpoint] == sent, endpoint


def test_grpc_without_a_grpc_service_at_its_address_exits_2_in_one_line(app, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    run = loadtest("--url", app.base_url, "--protocol", "v2,grpc", "--grpc-url", address, "--out", str(tmp_path))
    assert run.returncode == 2
    err = run.stderr.strip()
    assert "\n" not in err and err.startswith(f"mha-serving loadtest: no gRPC service at {address} for --protocol grpc")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "failed" and report["levels"] == [] and "nothing measured" in report["message"]


def test_request_count_bound_stops_a_level_before_its_duration(app, tmp_path):
    run = loadtest(
        *("--url", app.base_url, "--models", "mha-h4-d32", "--concurrency", "2", "--duration", "60"),
        *("--warmup", "0", "--max-requests", "15", "--protocol", "v2", "--out", str(tmp_path)),
    )
    assert run.returncode == 0, run.stderr
    (level,) = json.loads((tmp_path / "report.json").read_text())["levels"]
    assert level["sent"] == level["ok"] == 15 and level["stopped_by"] == "max_requests"
    assert level["duration_s"] < 60


def test_a_service_answering_errors_exits_1_with_errors_by_status_in_the_report(app, tmp_path):
    run = loadtest(
        *("--url", app.base_url, "--models", "mha-h2-d32", "--concurrency", "2", "--duration", "5"),
        *("--warmup", "0", "--batch-size", "65", "--out", str(tmp_path)),  # 65 rows: over the service's max_rows
    )
    assert run.returncode == 1
    assert run.stderr.strip().count("\n") == 0 and "no successful responses (400:" in run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (level,) = report["levels"]
    assert report["status"] == "failed" and level["ok"] == 0
    assert set(level["errors"]) == {"400"} and level["errors"]["400"] == level["sent"]
    assert "64" in level["error_examples"]["400"]  # the service's own message names its limit
    assert level["stopped_by"].startswith("aborted: the first")


def test_an_unknown_model_exits_2_naming_the_served_ones(app, tmp_path):
    run = loadtest("--url", app.base_url, "--models", "mha-h3-d32", "--out", str(tmp_path))
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"mha-serving loadtest: unknown model(s) mha-h3-d32; the service serves: {', '.join(MODELS)} "
        f"(report: {tmp_path})"
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "failed" and report["levels"] == [] and "nothing measured" in report["message"]


def test_ctrl_c_writes_what_was_measured_so_far(app, tmp_path):
    command = [sys.executable, "-m", "service.cli", "loadtest", "--url", app.base_url, "--concurrency", "2"]
    command += ["--duration", "60", "--warmup", "0", "--out", str(tmp_path)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:  # progress lines (every 5 s without a terminal) once the load has started
            if " sent " in line:
                break
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
        assert "(interrupted: 1 level(s)" in stdout
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted; wrote what was measured so far" in stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "interrupted"
    (level,) = report["levels"]  # the first model's first level; nothing after it was started
    assert level["stopped_by"] == "interrupted" and level["ok"] > 0 and level["duration_s"] < 60
    assert level["ok"] + sum(level["errors"].values()) == level["sent"]


def test_the_locustfile_drives_every_model_through_the_same_endpoints(app, tmp_path):
    locust = Path(sys.executable).with_name("locust")
    if not locust.exists():
        message = "locust is not installed (it is in the test extra: pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    command = [str(locust), "-f", str(ROOT / "loadtest" / "locustfile.py"), "--host", app.base_url, "--headless"]
    command += ["-u", "2", "-r", "2", "-t", "10s", "--csv", str(tmp_path / "locust"), "--only-summary"]
    env = {**os.environ, "MHA_SEQ_LEN": "uniform:4:20", "MHA_PROTOCOL": "v2", "MHA_BATCH_SIZE": "2"}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    with (tmp_path / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for model in MODELS:
        assert int(rows[f"{model} (v2)"]["Request Count"]) > 0 and rows[f"{model} (v2)"]["Failure Count"] == "0"


# What the load tester does with models that are never ready does not depend on where the models run: one placement.
@pytest.mark.parametrize("limited_service", ["colocated"], indirect=True)
def test_models_that_never_get_ready_make_a_partial_report_and_exit_1(limited_service, tmp_path):
    """The limited application serves one good model next to three broken folders (missing, corrupt, inconsistent)."""
    run = loadtest(
        *("--url", limited_service.base_url, "--models", "all", "--ready-timeout", "1", "--concurrency", "1"),
        *("--duration", "1", "--warmup", "0", "--out", str(tmp_path)),
    )
    assert run.returncode == 1, run.stderr
    assert (
        run.stderr.strip().count("\n") == 0 and "not ready after 1 s; skipped (+2 more, see the report)" in run.stderr
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "partial"
    assert [m["name"] for m in report["models"]] == ["mha-h2-d32"]
    assert [r["model"] for r in report["levels"]] == ["mha-h2-d32"] and report["levels"][0]["ok"] > 0
    for broken in ("mha-corrupt", "mha-h9-d32", "mha-missing"):
        assert f"{broken}: not ready after 1 s; skipped" in report["message"]
