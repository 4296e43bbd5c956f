"""The scaling benchmark's own parts (benchmarks/scale/): the levels planned from its command line, a window's
figures merged from the client processes, the share of answers per serving process, the ratios round by round, the
table and the bar's lines from a canned result; and one short run of the whole on a tiny model with 1 and 2
serving processes. The real runs are `python -m benchmarks.scale`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from benchmarks.scale.cli import parse_args
from benchmarks.scale.figures import merged, percentile_ms, shares, summary
from benchmarks.scale.levels import default_processes, parse_precisions, parse_processes, parse_variant, plan
from benchmarks.scale.loops import Outcome, Tally, content_length, served_by
from benchmarks.scale.report import printed, row_line, table
from benchmarks.scale.sample import GpuSampler, machine_ticks, thread_kind
from benchmarks.scale.servers import serve_level
from benchmarks.scale.verdict import verdict

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("cores", "expected"), [(1, [1]), (2, [1, 2]), (12, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16])])
def test_the_default_levels_are_powers_of_two_up_to_the_cores(cores, expected):
    assert default_processes(cores) == expected


def test_process_counts_are_sorted_once_each_and_a_bad_one_is_named():
    assert parse_processes("4, 1,2,2") == [1, 2, 4]
    for bad in ("0", "two", "1,-2", ""):
        with pytest.raises(ValueError, match="--processes"):
            parse_processes(bad)


def test_precisions_keep_their_order_and_fp16_needs_the_gpu():
    assert parse_precisions("fp32,fp16,fp32", "gpu") == ["fp32", "fp16"]
    with pytest.raises(ValueError, match="GPU only"):
        parse_precisions("fp16", "cpu")
    with pytest.raises(ValueError, match="bf16"):
        parse_precisions("bf16", "gpu")


def test_a_plan_is_every_precision_at_every_count_and_a_level_has_one_label():
    levels = plan(["int8", "fp32"], [2, 1])
    assert [x.label for x in levels] == ["int8 x1", "int8 x2", "fp32 x1", "fp32 x2"]


def test_a_variant_is_a_name_and_model_settings_the_service_accepts():
    assert parse_variant("block: gpu_wait=block, inline_on_gpu=true") == (
        "block",
        {"gpu_wait": "block", "inline_on_gpu": "true"},
    )
    assert parse_variant("defaults:") == ("defaults", {})
    for bad, why in [
        ("block", "NAME:KEY=VALUE"),
        ("a b:gpu_wait=block", "without spaces"),
        ("x:gpu_wait", "not KEY=VALUE"),
        ("x:gpu_wait=fast", "gpu_wait: Input should be"),
        ("x:no_such=1", "no_such: Extra inputs"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_variant(bad)


def test_variants_are_levels_of_their_own_beside_the_defaults_and_their_servers_get_the_settings(tmp_path):
    levels = plan(["fp16"], [2, 1], ["", "block"])
    assert [x.label for x in levels] == ["fp16 x1", "fp16 x2", "fp16 x1 block", "fp16 x2 block"]
    server = serve_level(tmp_path, "m", "gpu", 2, {"gpu_wait": "block"})
    assert server.config["deployment"] == {"gpu_wait": "block", "placement": "colocated"}
    assert serve_level(tmp_path, "m", "cpu", 1).config["deployment"] == {"placement": "colocated"}


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this ORT has CUDA")
def test_the_gpu_backend_without_cuda_is_one_line_and_exit_status_2_before_any_server_starts(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--backend", "gpu", "--model", "small"], cores=2)
    assert stopped.value.code == 2 and "CPU-only package" in capsys.readouterr().err


def test_profile_without_py_spy_is_one_line_and_exit_status_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("benchmarks.scale.cli.py_spy", lambda: str(tmp_path / "no-py-spy"))
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--profile", "--model", "small"], cores=2)
    assert stopped.value.code == 2 and "--profile needs py-spy" in capsys.readouterr().err


def test_a_head_names_its_serving_process_and_length_whatever_the_case():
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\nx-served-by: ab12\r\nInference-Header-Content-Length: 7\r\n\r\n"
    assert content_length(head) == 42 and served_by(head) == "ab12"
    assert served_by(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n") == ""
    with pytest.raises(ValueError, match="chunked"):
        content_length(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")


def test_only_what_ends_inside_the_window_counts():
    tally = Tally(start=10.0, deadline=12.0)
    tally.add(200, 0.5, 9.9, "a")  # the warm-up
    tally.add(200, 0.1, 10.5, "a")
    tally.add(503, 0.1, 11.0, "b")
    tally.add(200, 0.1, 12.1, "b")  # in flight at the deadline
    assert tally.latencies == [0.1] and tally.errors == 1 and tally.served_by == Counter(a=1)
    assert tally.failure == "HTTP 503"


def _outcome(latencies_ms, by, errors=0, cpu=0.5, wall=2.0, failure=""):
    return Outcome(np.array(latencies_ms) / 1e3, errors, Counter(by), cpu, wall, failure)


def test_a_windows_figures_merge_every_client_process():
    a = _outcome([1.0, 2.0, 3.0], {"p1": 2, "p2": 1}, cpu=0.5)
    b = _outcome([4.0, 100.0], {"p2": 2}, errors=1, cpu=1.8, failure="HTTP 503")
    got = merged([a, b], seconds=2.0)
    assert got["rate"] == 2.5 and got["errors"] == 1 and got["failure"] == "HTTP 503"
    assert got["p50_ms"] == pytest.approx(3.0) and got["p99_ms"] == pytest.approx(np.percentile([1, 2, 3, 4, 100], 99))
    assert got["served_by"] == {"p1": 2, "p2": 3}
    assert got["client_cpu_cores"] == pytest.approx(1.15) and got["client_busiest_pct"] == pytest.approx(90.0)
    assert math.isnan(percentile_ms(np.array([]), 50))


def test_shares_are_per_serving_process_largest_first():
    assert shares({"b": 1, "a": 3}) == {"a": 0.75, "b": 0.25}
    assert list(shares({"y": 2, "x": 2})) == ["x", "y"] and shares({}) == {}


def _level(rates, c1_ms, by, busy=None):
    rounds = []
    for rate, c1 in zip(rates, c1_ms, strict=True):
        r = {"rate": rate, "p50_ms": 10.0, "p99_ms": 20.0, "c1_p50_ms": c1, "errors": 0, "served_by": by}
        r |= {"server_cpu_cores": 1.5, "machine_busy_pct": 90.0, "serving_cpu_pct": {"7": 80.0}, "failure": ""}
        r |= {"client_cpu_cores": 0.3, "client_busiest_pct": 30.0, "thread_us": {"loop": c1 * 100, "runs": 40.0}}
        if busy is not None:
            r["gpu_busy_pct"] = busy
        rounds.append(r)
    medians = {k: float(np.median([r[k] for r in rounds])) for k, v in rounds[0].items() if isinstance(v, float)}
    return {**medians, "errors": 0, "rounds": rounds}


def _bare(rates, p50s):
    rounds = [{"best_rate": r, "p50_ms": p} for r, p in zip(rates, p50s, strict=True)]
    return {"best_rate": float(np.median(rates)), "p50_ms": float(np.median(p50s)), "rounds": rounds}


CPU_FACTS = {"backend": "cpu", "model": (4, 128), "precisions": ["fp32"], "processes": [1, 2], "cores": 2}


def _canned_cpu(two_rates):
    levels = plan(["fp32"], [1, 2])
    got = {
        "fp32 x1": _level([1000.0, 1100.0, 900.0], [0.5, 0.6, 0.4], {"a": 300}),
        "fp32 x2": _level(two_rates, [0.6, 0.6, 0.6], {"b": 200, "c": 100}),
    }
    bare = {"fp32": _bare([2000.0, 2000.0, 2000.0], [0.2, 0.2, 0.2])}
    return got, summary(levels, got, bare)


def test_a_levels_ratios_are_medians_of_the_round_by_round_ratios():
    _, rows = _canned_cpu([1100.0, 1100.0, 1080.0])
    two = rows["fp32 x2"]
    assert two["over_fewest"] == pytest.approx(1.1)  # 1.1, 1.0, 1.2 round by round
    assert two["over_bare"] == pytest.approx(0.55) and two["c1_minus_bare_ms"] == pytest.approx(0.4)
    assert two["shares"] == {"b": pytest.approx(2 / 3), "c": pytest.approx(1 / 3)}
    assert rows["fp32 x1"]["over_fewest"] == 1.0 and two["serving_cpu_pct"] == [80.0]
    assert "| fp32 x2 | 1,100 | 10.00 / 20.00 | 0.55 | 1.10 | 0.60 (+0.40) | 67/33 % |" in table(rows)


def test_the_two_core_line_is_judged_at_c32_and_the_gpu_lines_say_why_not():
    got, rows = _canned_cpu([900.0, 1000.0, 800.0])
    lines = {x.name: x for x in verdict(rows, got, {**CPU_FACTS, "connections": 32})}
    two = lines["2 cores: 2 processes over 1 at c=32"]
    assert two.ok is False and two.measured.startswith("0.90 x") and "NOT MET" in two.text
    assert lines["GPU busy"].ok is None and "--backend gpu" in lines["GPU busy"].text
    assert lines["CPU small model 8 processes over 1"].why_not == "needs --processes 1,8"
    at_16 = {x.name: x for x in verdict(rows, got, {**CPU_FACTS, "connections": 16})}
    assert at_16["2 cores: 2 processes over 1 at c=32"].ok is None


def test_the_gpu_lines_are_judged_at_each_precisions_saturation():
    levels = plan(["fp32", "fp16"], [1, 2])
    got = {
        "fp32 x1": _level([10_000.0, 10_000.0], [0.9, 0.9], {"a": 1}, busy=20.0),
        "fp32 x2": _level([18_000.0, 20_000.0], [0.9, 0.9], {"a": 1}, busy=40.0),
        "fp16 x1": _level([12_000.0, 12_000.0], [0.8, 0.8], {"a": 1}, busy=20.0),
        "fp16 x2": _level([27_000.0, 26_000.0], [0.8, 0.8], {"a": 1}, busy=65.0),
    }
    bare = {p: _bare([100_000.0, 100_000.0], [0.5, 0.5]) for p in ("fp32", "fp16")}
    rows = summary(levels, got, bare)
    facts = {"backend": "gpu", "model": (8, 512), "precisions": ["fp32", "fp16"], "processes": [1, 2], "cores": 16}
    lines = {x.name: x for x in verdict(rows, got, {**facts, "connections": 128})}
    assert lines["h8 d512 fp16 rate"].ok and lines["h8 d512 fp16 rate"].measured == "26,500 req/s at fp16 x2"
    assert lines["fp16 over fp32"].ok and lines["fp16 over fp32"].measured == "1.40 x (fp16 x2 over fp32 x2)"
    assert lines["c=1 p50 against bare"].ok and "+0.30" in lines["c=1 p50 against bare"].measured
    assert lines["GPU busy"].ok and lines["GPU busy"].measured == "65 % at fp16 x2"
    assert "65 %" in row_line("fp16 x2", rows["fp16 x2"])


def test_a_variant_is_set_against_its_own_fewest_processes_and_the_bar_names_the_level_it_was_met_at():
    levels = plan(["fp16"], [1, 2], ["", "block"])
    got = {
        "fp16 x1": _level([10_000.0, 10_000.0], [1.2, 1.2], {"a": 1}, busy=20.0),
        "fp16 x2": _level([20_000.0, 20_000.0], [1.2, 1.2], {"a": 1}, busy=40.0),
        "fp16 x1 block": _level([5_000.0, 5_000.0], [1.1, 1.1], {"a": 1}, busy=20.0),
        "fp16 x2 block": _level([26_000.0, 26_000.0], [1.1, 1.1], {"a": 1}, busy=70.0),
    }
    rows = summary(levels, got, {"fp16": _bare([100_000.0, 100_000.0], [0.5, 0.5])})
    assert rows["fp16 x2 block"]["over_fewest"] == pytest.approx(5.2)  # over fp16 x1 block, not fp16 x1
    assert rows["fp16 x2"]["over_fewest"] == pytest.approx(2.0) and rows["fp16 x2 block"]["variant"] == "block"
    facts = {"backend": "gpu", "model": (8, 512), "precisions": ["fp16"], "processes": [1, 2], "cores": 16}
    lines = {x.name: x for x in verdict(rows, got, {**facts, "connections": 128})}
    assert lines["h8 d512 fp16 rate"].measured == "26,000 req/s at fp16 x2 block" and lines["h8 d512 fp16 rate"].ok
    assert lines["GPU busy"].measured == "70 % at fp16 x2 block"


def test_grpc_answers_name_no_process_and_no_gpu_reads_na():
    _, rows = _canned_cpu([1100.0, 1100.0, 1080.0])
    row = {**rows["fp32 x2"], "shares": {"": 1.0}}
    assert row_line("fp32 x2", row).endswith("| n/a | 1.50 cores (machine 90 %) | 0.30 cores (30 %) | n/a |")


def test_a_levels_cpu_per_request_by_kind_of_thread_is_the_median_of_its_rounds():
    _, rows = _canned_cpu([1100.0, 1100.0, 1080.0])
    assert rows["fp32 x1"]["thread_us"] == {"loop": pytest.approx(50.0), "runs": 40.0}  # c=1 0.5, 0.6, 0.4 x 100
    assert rows["fp32 x1"]["stages"] == {}  # not profiled


def test_profiled_stages_are_medians_of_the_rounds_and_printed_in_microseconds_largest_first(capsys):
    levels = plan(["fp32"], [1])
    got = {"fp32 x1": _level([1000.0, 1100.0, 900.0], [0.5, 0.6, 0.4], {"a": 300})}
    for r, (ort_run, metrics) in zip(got["fp32 x1"]["rounds"], [(0.5, 0.3), (0.6, 0.2), (0.7, 0.1)], strict=True):
        r["stages"] = {"ORT run": ort_run, "metrics": metrics}
    rows = summary(levels, got, {"fp32": _bare([2000.0] * 3, [0.2] * 3)})
    assert rows["fp32 x1"]["stages"] == {"ORT run": pytest.approx(0.6), "metrics": pytest.approx(0.2)}
    scan = {"p50_threads": 1, "best_layout": "1 x 2 threads", "best_batch": 8}
    facts = {**CPU_FACTS, "rounds": 3, "seconds": 1.0, "protocol": "http", "clients": 1, "concurrency": 32}
    printed({"fp32": {"scan": scan, **_bare([2000.0] * 3, [0.2] * 3)}}, rows, [], facts)
    out = capsys.readouterr().out
    assert "  fp32 x1: ORT run 54, metrics 18" in out  # of 50 + 40 us a request


def test_a_serving_processs_threads_are_told_apart_by_their_os_names():
    kinds = [thread_kind(n) for n in ("mha-loop", "run:mha-h8-d512", "ort:mha-h8-d512", "ray::IDLE", "mha-loop2")]
    assert kinds == ["loop", "runs", "ort", "other", "other"]


def test_machine_ticks_and_gpu_samples():
    assert machine_ticks("cpu  10 0 5 80 5 0 0 0 0 0\ncpu0 1 2 3 4\n") == (15, 100)
    gpu = GpuSampler(enabled=False)
    with gpu:
        assert not gpu.present and gpu.busy_pct(0, 10) is None
    gpu.samples = [(1.0, 10.0), (2.0, 50.0), (3.0, 70.0), (9.0, 0.0)]
    assert gpu.busy_pct(1.5, 3.5) == 60.0


@pytest.mark.slow
@pytest.mark.serve
def test_a_short_run_serves_both_levels_and_both_processes_answer(tiny_models_dir, tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "benchmarks.scale", "--models", str(tiny_models_dir), "--model", "mha-h2-d32"]
    cmd += ["--processes", "1,2", "--seconds", "1", "--rounds", "1", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    levels = report["levels"]
    assert set(levels) == {"fp32 x1", "fp32 x2"}
    for row in levels.values():
        assert row["rate"] > 0 and row["errors"] == 0 and row["failure"] == "", row
    assert len([who for who in levels["fp32 x2"]["shares"] if who]) == 2, levels["fp32 x2"]["shares"]
    for row in levels.values():  # the loop and the run threads are named in every serving process, and busy
        assert row["thread_us"]["loop"] > 0 and row["thread_us"]["runs"] > 0, row["thread_us"]
    assert "| fp32 x2 |" in run.stdout and "the bar:" in run.stdout
