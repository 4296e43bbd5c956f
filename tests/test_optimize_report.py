"""The answer of `mha-serving optimize` from measured points: the cheapest that meets the SLO, the frontier, the
closest miss when none does, and the report's files (a serve config that loads, the winner's folder, the plots)."""

from __future__ import annotations

import json
from dataclasses import replace

import yaml

from optimize.report import Point, Slo, choose, pareto, write
from service.local.arguments import validated

BASE = Point(
    "m",
    "fp32",
    1.0,
    {"processes": 1, "intra_op_threads": 2, "max_batch_size": 32, "batch_wait_ms": 0.0},
    2.0,
    0.0,
    (-0.1, 0.1),
    1.0,
    40.0,
    30.0,
    50.0,
)


def test_the_cheapest_point_meeting_a_rate_slo_wins_and_a_failed_one_never_does():
    fast_but_costly = replace(BASE, candidate="a", cores=2.0, p99_ms=10.0)
    cheap = replace(BASE, candidate="b", precision="int8", cores=1.0, p99_ms=45.0, accuracy_drop=0.3)
    too_slow = replace(BASE, candidate="c", cores=1.0, p99_ms=80.0)
    broken = replace(BASE, candidate="d", cores=0.5, p99_ms=None, failure="did not start")
    answer = choose([fast_but_costly, cheap, too_slow, broken], Slo(p99_ms=50.0, rate=100.0))
    assert answer.winner == cheap
    assert "fewest cores (1)" in answer.why and "2 of 4" in answer.why


def test_without_a_point_meeting_the_slo_the_closest_miss_is_named():
    points = [replace(BASE, candidate="a", p99_ms=70.0), replace(BASE, candidate="b", p99_ms=60.0)]
    answer = choose(points, Slo(p99_ms=50.0, rate=100.0))
    assert answer.winner is None and answer.closest.candidate == "b" and "no configuration meets" in answer.why


def test_the_frontier_keeps_only_points_no_other_beats_on_both_drop_and_latency():
    a = replace(BASE, candidate="a", p99_ms=10.0, accuracy_drop=0.4)
    b = replace(BASE, candidate="b", p99_ms=20.0, accuracy_drop=0.1)
    dominated = replace(BASE, candidate="c", p99_ms=25.0, accuracy_drop=0.2)
    assert [p.candidate for p in pareto([a, b, dominated], lambda p: p.p99_ms)] == ["a", "b"]


def test_the_report_writes_a_serve_config_that_loads_the_winners_folder_and_the_plots(tmp_path):
    candidates = tmp_path / "candidates"
    (candidates / "b").mkdir(parents=True)
    (candidates / "b" / "model.onnx").write_bytes(b"onnx")
    settings = {"processes": 2, "intra_op_threads": 1, "max_batch_size": 8, "batch_wait_ms": 2.0}
    winner = replace(BASE, candidate="b", settings=settings)
    points = [winner, replace(BASE, candidate="a", p99_ms=90.0)]
    answer = choose(points, Slo(p99_ms=50.0, rate=100.0))
    report = write(
        tmp_path / "out", answer, points, Slo(p99_ms=50.0, rate=100.0), ["mha-serving optimize ..."], candidates
    )
    out = report.parent
    config = validated(yaml.safe_load((out / "serve.yaml").read_text()))
    assert config.models == ["b"] and config.ingress.processes == 2 and config.deployment.intra_op_threads == 1
    assert config.deployment.batch_wait_timeout_s == 0.002 and config.models_dir == str(out / "winner")
    assert (out / "winner" / "b" / "model.onnx").read_bytes() == b"onnx"
    data = json.loads((out / "report.json").read_text())
    assert data["winner"]["candidate"] == "b" and data["machine"]["cores"] >= 1 and data["commands"]
    assert {"frontier_p99.png", "frontier_throughput.png"} <= {p.name for p in out.iterdir()}
    assert "**Winner: b [" in report.read_text()


def test_the_report_shows_each_fresh_runs_figures_beside_the_first_and_the_verdict(tmp_path):
    candidates = tmp_path / "candidates"
    (candidates / "b").mkdir(parents=True)
    (candidates / "b" / "model.onnx").write_bytes(b"onnx")
    slo = Slo(p99_ms=50.0, rate=20.0, headroom=0.15)
    knee = replace(BASE, candidate="a", cores=1.0, p99_ms=30.0, max_rate=24.0)
    steady = replace(BASE, candidate="b", p99_ms=20.0, max_rate=40.0)
    confirmations = {knee.label: replace(knee, p99_ms=55.0, max_rate=19.0), steady.label: replace(steady, p99_ms=22.0)}
    answer = choose([knee, steady], slo, confirmations)
    assert answer.winner == steady and "with 15% headroom" in answer.why
    report = write(tmp_path / "out", answer, [knee, steady], slo, ["mha-serving optimize ..."], candidates).read_text()
    assert f"- {knee.label}: not confirmed on a fresh server: p99 30.0 -> 55.0 (1.83 x), max rate 24 -> 19" in report
    assert f"- {steady.label}: confirmed on a fresh server: p99 20.0 -> 22.0 (1.10 x)" in report
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["slo"]["headroom"] == 0.15 and data["confirmations"][knee.label]["p99_ms"] == 55.0
