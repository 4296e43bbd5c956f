"""`mha-serving loadtest` against decoders served by `mha-serving serve`: streamed completions per head configuration
(two decoders, kv_heads 1 and 4, beside a classifier), timed per token by the client and read from the server's own
histograms, goodput under given SLOs, the report's files, `--compare`, and bad inputs refused in one line.

One closed-loop run (both decoders, OpenAI and OIP streams taking turns) and one short open-loop run serve the
checks; each is a few seconds of load.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import export_tiny_decoder, export_tiny_model

from benchmarks.harness.server import ServerProcess
from service.local.ports import free_port

pytestmark = [pytest.mark.serve, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
DECODERS = ("lm-h4-kv1-d32", "lm-h4-kv4-d32")
CLASSIFIER = "mha-h2-d32"
OUTPUT_TOKENS = 12
SLO_TTFT_MS, SLO_ITL_MS = 250.0, 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("loadtest-decoders")
    export_tiny_decoder(out, 1, 128, seed=1, spread=False)
    export_tiny_decoder(out, 4, 128, seed=4, spread=False)
    export_tiny_model(out, heads=2, seed=2)
    config = {"models_dir": str(out), "backend": "cpu", "generate": {"threads": 1}}
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # Ray's export every second, as tests/serving.py
    with ServerProcess(config) as running:
        yield running


def loadtest(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "service.cli", "loadtest", "--quiet", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def closed_run(server, tmp_path_factory) -> Path:
    """Both decoders (a classifier is served too: --generate leaves it out), OpenAI and OIP streams, c=2."""
    out = tmp_path_factory.mktemp("closed-run")
    done = loadtest(
        "--url", _url(server), "--generate", "--protocol", "openai,oip", "--concurrency", "2", "--duration", "3",
        "--warmup", "0.5", "--prompt-tokens", "8:24", "--output-tokens", str(OUTPUT_TOKENS),
        "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-itl-ms", str(SLO_ITL_MS),
        "--metrics-url", f"http://127.0.0.1:{server.metrics_port}/metrics", "--metrics-wait", "30", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    return out


def _levels(out: Path) -> list[dict]:
    return json.loads((out / "report.json").read_text())["levels"]


def test_a_closed_loop_run_reports_each_decoder_with_stream_percentiles_and_exact_output_tokens(closed_run):
    report = json.loads((closed_run / "report.json").read_text())
    assert report["workload"] == "generate" and report["status"] == "complete"
    assert any(CLASSIFIER in note and "not measured" in note for note in report["notes"])
    levels = report["levels"]
    assert sorted((lv["model"], lv["protocol"]) for lv in levels) == sorted(
        (m, p) for m in DECODERS for p in ("openai", "oip")
    )
    for lv in levels:
        g = lv["generation"]
        assert lv["kv_heads"] == int(lv["model"].split("-kv")[1].split("-")[0])
        assert lv["ok"] > 0 and lv["errors"] == {}, lv
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert 0 < g[key]["p50"] <= g[key]["p90"] <= g[key]["p99"], (key, g[key])
        assert g["ttft_ms"]["p50"] <= g["e2e_ms"]["p50"]
        assert g["requests"] == lv["ok"] and g["output_tokens"] == lv["ok"] * OUTPUT_TOKENS
        assert g["output_tokens_per_s"] == pytest.approx(g["output_tokens"] / lv["duration_s"], rel=1e-3)


def test_goodput_is_the_share_of_streams_within_both_slos(closed_run):
    with (closed_run / "streams.csv").open() as f:
        streams = list(csv.DictReader(f))
    for lv in _levels(closed_run):
        rows = [r for r in streams if (r["model"], r["protocol"], r["level"]) == (lv["model"], lv["protocol"], "c=2")]
        assert len(rows) == lv["ok"] and all(int(r["output_tokens"]) == OUTPUT_TOKENS for r in rows)
        good = [r for r in rows if float(r["ttft_ms"]) <= SLO_TTFT_MS and float(r["itl_max_ms"] or 0) <= SLO_ITL_MS]
        assert [r["meets_slo"] == "1" for r in rows] == [r in good for r in rows]
        goodput = lv["generation"]["goodput"]
        assert (goodput["slo_ttft_ms"], goodput["slo_itl_ms"]) == (SLO_TTFT_MS, SLO_ITL_MS)
        assert goodput["good"] == len(good)
        assert goodput["share"] == pytest.approx(len(good) / (lv["ok"] + sum(lv["errors"].values())), abs=1e-6)
        assert goodput["rate_rps"] == pytest.approx(len(good) / lv["duration_s"], abs=1e-3)


def test_the_servers_ttft_histogram_counted_each_measured_request_and_its_itl_is_beside_it(closed_run):
    for lv in _levels(closed_run):
        assert lv["server"]["metric"] == "ray_mha_time_to_first_token_seconds"
        assert lv["server"]["count"] == lv["ok"], lv["server"]
        itl = lv["generation"]["server_also"]["ray_mha_inter_token_latency_seconds"]
        assert itl["count"] == lv["ok"] * (OUTPUT_TOKENS - 1), itl


def test_the_report_files_carry_the_generation_columns_and_plot(closed_run):
    with (closed_run / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    for row in rows:
        assert row["kv_heads"] in ("1", "4") and float(row["ttft_p99_ms"]) >= float(row["ttft_p50_ms"]) > 0
        assert float(row["itl_p50_ms"]) > 0 and row["goodput_share"] != "" and row["server_itl_p50_ms"] != ""
    md = (closed_run / "report.md").read_text()
    assert "## Generation per model and load level" in md and "TTFT p99" in md and "server ITL p99" in md
    assert "## Per model and load level\n" not in md  # no classifier table for a decoders' run
    png = closed_run / "generation_latency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![generation_latency.png](generation_latency.png)" in md


def test_compare_puts_ttft_itl_and_goodput_of_two_runs_side_by_side(closed_run, tmp_path):
    done = loadtest("--compare", str(closed_run), str(closed_run / "report.json"), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "A TTFT p50 ms" in done.stdout and "itl_p99 B/A" in done.stdout and "goodput %" in done.stdout
    rows = json.loads((tmp_path / "compare.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["values"]["ttft_p50"][2] == 1.0 for r in rows)


def test_an_open_loop_run_of_one_decoder_needs_no_generate_flag(server, tmp_path):
    """A decoder named alone is loaded with streams; Poisson arrivals over OIP, drawn output lengths."""
    done = loadtest(
        "--url", _url(server), "--models", DECODERS[1], "--protocol", "oip", "--concurrency", "", "--rate", "4",
        "--duration", "2", "--warmup", "0", "--output-tokens", "4:8", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    (level,) = _levels(tmp_path)
    with (tmp_path / "streams.csv").open() as f:
        tokens = [int(r["output_tokens"]) for r in csv.DictReader(f)]
    assert level["mode"] == "open" and level["ok"] == len(tokens) > 0
    assert all(4 <= n <= 8 for n in tokens) and level["generation"]["output_tokens"] == sum(tokens)
    assert "goodput" not in level["generation"]  # no SLO given


def test_a_grpc_run_streams_through_the_generation_rpc(server, tmp_path):
    done = loadtest(
        "--url", _url(server), "--grpc-url", f"127.0.0.1:{server.grpc_port}", "--models", DECODERS[0],
        "--protocol", "grpc", "--concurrency", "2", "--duration", "2", "--warmup", "0",
        "--output-tokens", str(OUTPUT_TOKENS), "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    (level,) = _levels(tmp_path)
    assert level["protocol"] == "grpc" and level["ok"] > 0
    assert level["generation"]["output_tokens"] == level["ok"] * OUTPUT_TOKENS


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--generate", "--slo-itl-ms", "-5"], "--slo-itl-ms must be > 0"),
        (["--generate", "--prompt-tokens", "256:32"], "LO must be <= HI"),
        (["--generate", "--protocol", "simple"], "generation takes one or more of openai, oip, grpc"),
        (["--generate", "--models", CLASSIFIER], "a classifier, and a generation run loads decoders only"),
        (["--models", f"{CLASSIFIER},{DECODERS[0]}"], "a decoder; load decoders in a run of their own"),
        (["--generate", "--output-tokens", "200"], "leaves no room for a prompt"),
        (["--generate", "--protocol", "grpc", "--grpc-url", "GRPC"], "no gRPC service at"),
    ],
    ids=["negative-slo", "reversed-prompt-range", "classifier-protocol", "classifier-model", "mixed-models",
         "output-over-context", "grpc-without-port"],
)  # fmt: skip
def test_a_bad_generation_input_exits_2_with_one_line(server, tmp_path, args, says):
    args = [a.replace("GRPC", f"127.0.0.1:{free_port()}") for a in args]
    done = loadtest("--url", _url(server), "--duration", "1", "--out", str(tmp_path), *args, timeout=60)
    assert done.returncode == 2, done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mha-serving loadtest: ") and says in lines[0], done.stderr
