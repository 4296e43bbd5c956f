"""Load test reports: JSON/CSV/Markdown written and read back unchanged, plots drawn, two reports compared."""

from __future__ import annotations

import csv
import json
import math

import pytest

from loadtest.cli import main
from loadtest.compare import compare, ratio
from loadtest.compare import markdown as compare_markdown
from loadtest.plots import kinds, series, write_plots
from loadtest.report import CSV_COLUMNS, ReportError, build_report, load_report, write_report
from loadtest.stats import LevelResult


def level(model: str, heads: int, mode: str, value: float, p50: float, rps: float, **extra) -> LevelResult:
    latency = {"p50": p50, "p90": p50 * 1.5, "p95": p50 * 1.8, "p99": p50 * 2.5, "max": p50 * 4, "mean": p50 * 1.1}
    return LevelResult(
        model=model,
        heads=heads,
        head_dim=32 // heads,
        d_model=32,
        mode=mode,
        concurrency=int(value) if mode == "closed" else 64,
        offered_rate=value if mode == "open" else 0.0,
        batch_size=1,
        duration_s=2.0,
        sent=int(rps * 2) + 3,
        ok=int(rps * 2),
        errors={"503": 2, "timeout": 1},
        throughput_rps=rps,
        sequences_per_s=rps,
        latency_ms=latency,
        error_examples={"503": "over capacity"},
        **extra,
    )


def sample_results(scale: float = 1.0) -> list[LevelResult]:
    out = []
    for heads in (2, 4):
        name = f"mha-h{heads}-d32"
        for c in (1, 8):
            out.append(level(name, heads, "closed", c, p50=heads * c * scale, rps=100.0 * c / heads))
        server = {"metric": "lat_ms", "count": 99, "p50": 1.0, "p90": 2.0, "p95": 2.5, "p99": 3.0}
        out.append(level(name, heads, "open", 50.0, p50=heads * 3.0 * scale, rps=49.0, dropped=1, server=server))
    return out


def test_report_files_round_trip(tmp_path):
    results = sample_results()
    report = build_report({"status": "complete", "url": "http://127.0.0.1:1"}, results, ["a note"])
    plots = write_plots(results, tmp_path)
    write_report(tmp_path, report, results, plots)

    meta, loaded = load_report(tmp_path)
    assert loaded == results and meta["status"] == "complete" and meta["notes"] == ["a note"]
    assert load_report(tmp_path / "report.json")[1] == results

    with (tmp_path / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results)
    for row, r in zip(rows, results, strict=True):
        assert (row["model"], row["level"], int(row["ok"])) == (r.model, r.level, r.ok)
        assert float(row["p99_ms"]) == r.latency_ms["p99"] and float(row["throughput_rps"]) == r.throughput_rps
        assert row["errors"] == "503:2;timeout:1" and int(row["errors_total"]) == 3
        assert row["server_p99_ms"] == ("3.0" if r.mode == "open" else "")

    md = (tmp_path / "report.md").read_text()
    assert md.count("| mha-h2-d32 |") == 3 + 6  # three levels in the main table, two error kinds per level
    assert "server p99 ms" in md and "over capacity" in md and "- a note" in md
    for name in plots:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({name})" in md
    assert sorted(plots) == ["latency_throughput.png", "latency_vs_heads.png", "throughput_vs_concurrency.png"]


def test_a_report_with_nothing_measured_still_writes_and_says_so(tmp_path):
    write_report(tmp_path, build_report({"status": "failed"}, [], []), [], write_plots([], tmp_path))
    assert "Nothing was measured." in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["levels"] == []
    assert not list(tmp_path.glob("*.png"))


def test_compare_gives_b_over_a_ratios_for_matching_levels():
    a, b = sample_results(1.0), sample_results(2.0)
    b = [r for r in b if not (r.model == "mha-h4-d32" and r.level == "c=8")]
    rows, only = compare(a, b)
    assert len(rows) == len(a) - 1
    assert only == ["only in A: mha-h4-d32 simple c=8"]
    for row in rows:
        assert row.values["p50"][2] == pytest.approx(2.0)
        assert row.values["p99"][2] == pytest.approx(2.0)
        assert row.values["throughput_rps"][2] == pytest.approx(1.0)
    assert math.isnan(ratio(0.0, 1.0)) and math.isnan(ratio(math.nan, 1.0))


def test_compare_cli_prints_and_writes_the_side_by_side_table(tmp_path, capsys):
    for name, scale in (("a", 1.0), ("b", 0.5)):
        results = sample_results(scale)
        write_report(tmp_path / name, build_report({"status": "complete"}, results, []), results, [])
    assert main(["--compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "| mha-h2-d32 | 2 | fp32 | simple | c=8 |" in printed and "0.50" in printed
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert len(data["rows"]) == 6 and data["unmatched"] == []
    assert (tmp_path / "cmp" / "compare.md").read_text() == printed.rstrip("\n") + "\n"


def test_loading_something_that_is_not_a_report_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "report.json").write_text('{"hello": 1}')
    with pytest.raises(ReportError, match="no 'levels' list"):
        load_report(tmp_path)
    assert main(["--compare", str(tmp_path), str(tmp_path / "missing")]) == 2
    assert "no 'levels' list" in capsys.readouterr().err


def precision_pair(scale: float = 1.0) -> list[LevelResult]:
    """An fp32 model and its int8 variant: the same h, two precisions."""
    fp32 = [level("mha-h2-d32", 2, "closed", c, p50=2.0 * c * scale, rps=50.0 * c) for c in (1, 8)]
    int8 = [level("mha-h2-d32-int8", 2, "closed", c, p50=c * scale, rps=80.0 * c, precision="int8") for c in (1, 8)]
    return fp32 + int8


def test_the_same_h_at_two_precisions_is_two_rows_and_two_series(tmp_path):
    results = precision_pair()
    write_report(tmp_path, build_report({"status": "complete"}, results, []), results, write_plots(results, tmp_path))

    with (tmp_path / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["model"], row["heads"], row["precision"]) for row in rows] == [
        ("mha-h2-d32", "2", "fp32"),
        ("mha-h2-d32", "2", "fp32"),
        ("mha-h2-d32-int8", "2", "int8"),
        ("mha-h2-d32-int8", "2", "int8"),
    ]
    md = (tmp_path / "report.md").read_text()
    assert "| model | h | precision | head_dim | protocol | level |" in md
    assert md.count("| mha-h2-d32 | 2 | fp32 | 16 |") == 2 and md.count("| mha-h2-d32-int8 | 2 | int8 | 16 |") == 2

    assert list(series(results)) == ["h=2 fp32 (mha-h2-d32)", "h=2 int8 (mha-h2-d32-int8)"]
    assert kinds(results) == [
        ("fp32", "simple"),
        ("int8", "simple"),
    ]  # latency_vs_heads: a line per percentile and kind
    assert list(series(list(reversed(results)))) == ["h=2 fp32 (mha-h2-d32)", "h=2 int8 (mha-h2-d32-int8)"]


def test_the_csv_has_precision_after_the_head_configuration_then_protocol_before_the_load_mode():
    assert CSV_COLUMNS[:7] == ["model", "heads", "head_dim", "d_model", "precision", "protocol", "mode"]
    assert len(CSV_COLUMNS) == len(set(CSV_COLUMNS))


def test_a_report_from_before_precision_was_recorded_reads_as_fp32(tmp_path):
    results = sample_results()
    write_report(tmp_path, build_report({"status": "complete"}, results, []), results, [])
    report = json.loads((tmp_path / "report.json").read_text())
    for entry in report["levels"]:
        del entry["precision"]
    (tmp_path / "report.json").write_text(json.dumps(report))

    _, loaded = load_report(tmp_path)
    assert loaded == results and {r.precision for r in loaded} == {"fp32"}


def test_compare_matches_each_precision_separately_and_names_it():
    rows, only = compare(precision_pair(1.0), precision_pair(0.5))
    assert only == [] and [(r.model, r.precision, r.level) for r in rows] == [
        ("mha-h2-d32", "fp32", "c=1"),
        ("mha-h2-d32", "fp32", "c=8"),
        ("mha-h2-d32-int8", "int8", "c=1"),
        ("mha-h2-d32-int8", "int8", "c=8"),
    ]
    assert all(row.values["p50"][2] == pytest.approx(0.5) for row in rows)
    text = compare_markdown(rows, only, "a", "b")
    assert (
        "| model | h | precision | protocol | level |" in text
        and "| mha-h2-d32-int8 | 2 | int8 | simple | c=8 |" in text
    )


def protocol_trio(scale: float = 1.0) -> list[LevelResult]:
    """One model at two levels under three protocols, in the order a run measures them (protocols take turns)."""
    return [
        level("mha-h2-d32", 2, "closed", c, p50=(k + 1) * c * scale, rps=100.0 * c / (k + 1), protocol=protocol)
        for c in (1, 8)
        for k, protocol in enumerate(("v2", "v2-binary", "grpc"))
    ]


def test_several_protocols_are_a_column_a_side_by_side_table_and_a_series_each(tmp_path):
    results = protocol_trio()
    write_report(tmp_path, build_report({"status": "complete"}, results, []), results, write_plots(results, tmp_path))

    with (tmp_path / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["protocol"], row["level"], float(row["p50_ms"])) for row in rows] == [
        (r.protocol, r.level, r.latency_ms["p50"]) for r in results
    ]
    md = (tmp_path / "report.md").read_text()
    for r in results:
        assert f"| mha-h2-d32 | 2 | fp32 | 16 | {r.protocol} | {r.level} | {r.ok} |" in md
    side_by_side = md.split("## Per model and load level, protocols side by side")[1].split("##")[0]
    assert "| model | level | v2 p50 ms | v2 p99 ms | v2 req/s | v2-binary p50 ms |" in side_by_side
    by_level = {(r.level, r.protocol): r for r in results}
    for lv in ("c=1", "c=8"):
        cells = [by_level[(lv, p)] for p in ("v2", "v2-binary", "grpc")]
        expected = [x for r in cells for x in (r.latency_ms["p50"], r.latency_ms["p99"], r.throughput_rps)]
        assert f"| mha-h2-d32 | {lv} | " + " | ".join(f"{x:.2f}" if x < 100 else f"{x:.1f}" for x in expected) in md

    assert list(series(results)) == [f"h=2 fp32 {p} (mha-h2-d32)" for p in ("v2", "v2-binary", "grpc")]
    assert kinds(results) == [("fp32", "v2"), ("fp32", "v2-binary"), ("fp32", "grpc")]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(write_plots(results, tmp_path))


def test_one_protocol_has_no_side_by_side_table_and_keeps_its_series_names(tmp_path):
    results = [r for r in protocol_trio() if r.protocol == "grpc"]
    write_report(tmp_path, build_report({"status": "complete"}, results, []), results, [])
    assert "protocols side by side" not in (tmp_path / "report.md").read_text()
    assert list(series(results)) == ["h=2 fp32 (mha-h2-d32)"]


def test_a_report_from_before_levels_had_a_protocol_reads_as_its_runs_protocol(tmp_path):
    results = sample_results()
    write_report(tmp_path, build_report({"status": "complete", "protocol": "v2"}, results, []), results, [])
    report = json.loads((tmp_path / "report.json").read_text())
    for entry in report["levels"]:
        del entry["protocol"]
    (tmp_path / "report.json").write_text(json.dumps(report))

    _, loaded = load_report(tmp_path)
    assert {r.protocol for r in loaded} == {"v2"}


def test_compare_matches_each_protocol_separately():
    a = protocol_trio(1.0)
    b = [r for r in protocol_trio(2.0) if not (r.protocol == "grpc" and r.level == "c=8")]
    rows, only = compare(a, b)
    assert [(r.protocol, r.level) for r in rows] == [(r.protocol, r.level) for r in b]
    assert all(row.values["p50"][2] == pytest.approx(2.0) for row in rows)
    assert only == ["only in A: mha-h2-d32 grpc c=8"]
    assert "| mha-h2-d32 | 2 | fp32 | v2-binary | c=1 |" in compare_markdown(rows, only, "a", "b")
