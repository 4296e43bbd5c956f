"""The kernel benchmark's pure parts: FLOP counting, the bar's and the int8 ratios, interleaved timing, the
MatMulInteger peak graph, the report files; and one tiny run end to end. No timed assertions: the bench itself runs
by hand (`python -m benchmarks.kernel`)."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from benchmarks.kernel import report
from benchmarks.kernel.cli import parse_args
from benchmarks.kernel.gemm import INT8_ZERO_POINT, BoundGemm, Peaks, gemm_peaks, matmul_integer_model, matmul_model
from benchmarks.kernel.runs import QUICK, RUNNERS, BenchConfig, Timing, forward_flops, run
from benchmarks.kernel.summary import geomean, summarize
from benchmarks.kernel.timing import time_interleaved
from export.model import EncoderConfig
from export.quantize import Int8Plan, cpu_flags, plan_int8


def test_forward_flops_counts_projections_attention_and_mlp():
    config = EncoderConfig(d_model=512, heads=8, layers=4, max_len=512)
    per_token_layer = 2 * 512 * 4 * 512 + 2 * 2 * 512 * 2048 + 2 * 2 * 128 * 512
    assert forward_flops(config, 8, 128) == 4 * 8 * 128 * per_token_layer
    assert forward_flops(config, 1, 32) * 16 < forward_flops(config, 1, 512)  # attention grows with T^2
    narrow = EncoderConfig(d_model=512, heads=3, head_dim=128, layers=4, max_len=512)  # inner 384, not 512
    assert forward_flops(narrow, 1, 32) < forward_flops(config, 1, 32)
    flops = {h: forward_flops(EncoderConfig(d_model=512, heads=h, layers=4, max_len=512), 8, 512) for h in QUICK.heads}
    assert len(set(flops.values())) == 1  # every h does the same FLOPs


def _timings(ms: dict[tuple[int, str], float]) -> list[Timing]:
    return [Timing(h, 8, 512, runner, value, 1000.0 / value) for (h, runner), value in ms.items()]


def test_summary_ratios_follow_the_bar_definitions():
    ms = {(1, "torch"): 600.0, (1, "ort-unfused"): 550.0, (1, "ort-fused"): 400.0}
    ms |= {(16, "torch"): 630.0, (16, "ort-unfused"): 1000.0, (16, "ort-fused"): 420.0}
    ms |= {(2, "torch"): 100.0, (2, "ort-unfused"): 100.0, (2, "ort-fused"): 500.0}  # h=2: not a bar head
    summary = summarize(_timings(ms), Peaks(fp32_gflops=3.0, int8_gops=12.0))
    assert summary["fused_vs_torch"] == {"h1 8x512": 1.5, "h16 8x512": 1.5}
    assert summary["fused_vs_torch_min"] == 1.5 and math.isclose(summary["fused_vs_torch_geomean"], 1.5)
    assert math.isclose(summary["h16_over_h1_8x512"]["ort-fused"], 420 / 400)
    assert summary["best_fused"]["shape"] == "h1 8x512" and math.isclose(summary["best_fused_vs_peak"], 2.5 / 3.0)
    assert all(summary["bar"].values())
    assert math.isclose(geomean([1.0, 4.0]), 2.0) and math.isnan(geomean([]))
    # no int8 rows: the int8 ratios are NaN, the peaks' ratio is still there
    assert summary["int8_vs_fused"] == {} and math.isnan(summary["int8_vs_fused_geomean"])
    assert math.isnan(summary["best_int8_vs_int8_peak"]) and summary["int8_peak_vs_fp32_peak"] == 4.0


def test_summary_sets_int8_against_fused_fp32_and_the_int8_peak():
    values = (600.0, 500.0, 400.0, 200.0)
    ms = {(h, runner): value for h in (1, 16) for runner, value in zip(RUNNERS, values, strict=True)}
    ms[16, "ort-int8"] = 100.0  # 4x the fused graph; useful GOP/s 10
    plan = Int8Plan("s8", False, "test")
    summary = summarize(_timings(ms), Peaks(fp32_gflops=2.0, int8_gops=20.0, fp32_ort_gflops=5.0), plan)
    assert summary["int8_vs_fused"] == {"h1 8x512": 2.0, "h16 8x512": 4.0}
    assert summary["int8_vs_fused_min"] == 2.0 and summary["int8_vs_fused_max"] == 4.0
    assert math.isclose(summary["int8_vs_fused_geomean"], math.sqrt(8.0))
    assert summary["best_int8"] == {"shape": "h16 8x512", "gflops": 10.0}
    assert math.isclose(summary["best_int8_vs_int8_peak"], 0.5)
    assert summary["int8_gemm_peak_gops"] == 20.0 and summary["int8_peak_vs_fp32_peak"] == 10.0
    assert summary["int8_peak_vs_ort_fp32_peak"] == 4.0 and summary["best_fused_vs_ort_fp32_peak"] == 0.5
    assert summary["int8_plan"] == {"weights": "s8", "reduce_range": False, "reason": "test"}
    assert summary["best_fused"]["shape"] == "h1 8x512"  # int8 rows do not count as fused ones


def test_time_interleaved_gives_every_call_a_median_and_runs_each_repeatedly():
    counts = {"a": 0, "b": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    ms = time_interleaved({"a": bump, "b": bump}, ("a",), repeats=3, settle_s=0.0)
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
    assert counts["a"] >= 2 * (1 + 3 * 2) and counts["b"] == 0  # both got ("a",): warm-up, then untimed + timed


def test_report_table_ratios_and_files(tmp_path):
    values = (300.0, 250.0, 200.0, 80.0)
    ms = {(h, runner): value for h in (1, 16) for runner, value in zip(RUNNERS, values, strict=True)}
    timings = _timings(ms)
    summary = summarize(timings, Peaks(fp32_gflops=10.0, int8_gops=25.0, fp32_ort_gflops=20.0))
    table = report.table(timings).splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| 1 | 8 x 512 | 300.0 | 250.0 | 200.0 | 80.0 | 5 | 12 |")
    assert table[2].endswith("| 1.50x | 1.25x | 2.50x |")
    ratios = report.ratios(summary)
    assert "[met] ORT never slower than torch" in ratios
    assert "int8 GEMM peak 25 GOP/s = 2.50x torch's fp32 peak, 1.25x ORT's fp32 MatMul peak" in ratios
    assert "12 useful GOP/s = 0.50 of the int8 peak" in ratios and "(ORT's fp32 MatMul peak 20 GFLOP/s: 0.25" in ratios
    assert "ORT int8 vs fp32 fused, all h: min 2.50x, geometric mean 2.50x, max 2.50x" in ratios
    config = {"d_model": 512, "layers": 4}
    paths = report.write(tmp_path / "out", config, {"cpus": 2}, timings, summary)
    assert [p.name for p in paths] == ["kernel_bench.csv", "kernel_bench.json", "kernel_bench.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    record = json.loads(paths[1].read_text())
    assert len(record["timings"]) == 8 and record["summary"]["fused_vs_torch_min"] == 1.5
    assert record["summary"]["int8_gemm_peak_gops"] == 25.0 and record["summary"]["ort_fp32_gemm_peak_gflops"] == 20.0
    assert {t["runner"] for t in record["timings"]} == set(RUNNERS)
    assert paths[0].read_text().splitlines()[0] == "heads,batch,tokens,runner,ms,gflops"


def test_report_table_without_int8_rows_says_so():
    ms = {(1, runner): value for runner, value in zip(RUNNERS[:3], (300.0, 250.0, 200.0), strict=True)}
    row = report.table(_timings(ms)).splitlines()[2]
    assert "| 200.0 | n/a | 5 | n/a |" in row and row.endswith("| n/a |")


@pytest.mark.parametrize("weights", ["s8", "u8"])
def test_matmul_integer_graph_is_valid_and_computes_the_integer_product_with_this_cpus_plan(weights):
    """Exact with the weights the quantizer would write here: without VNNI, ORT's u8 x s8 kernel adds pairs of
    products in 16 bits, which full-range s8 weights can saturate, so the plan for such a CPU takes 7 bits."""
    plan = plan_int8(cpu_flags(), weights=weights)
    m, k, n = 8, 32, 16
    model = matmul_integer_model(m, k, n, plan.weights, plan.reduce_range)
    onnx.checker.check_model(model, full_check=True)
    assert [node.op_type for node in model.graph.node] == ["MatMulInteger"]
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert inputs == {"a": onnx.TensorProto.UINT8}  # the weights are an initializer, not an input
    b = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "b"))  # (K, N)
    assert b.dtype == (np.int8 if weights == "s8" else np.uint8) and b.shape == (k, n)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = np.random.default_rng(3).integers(0, 256, size=(m, k), dtype=np.uint8)  # (M, K)
    (y,) = session.run(None, {"a": a})
    assert y.dtype == np.int32 and y.shape == (m, n)
    np.testing.assert_array_equal(y, (a.astype(np.int32) - INT8_ZERO_POINT) @ b.astype(np.int32))
    with pytest.raises(ValueError, match="weights"):
        matmul_integer_model(m, k, n, "s4")


@pytest.mark.parametrize(
    "weights, reduce_range, span",
    [("s8", False, (-128, 127)), ("s8", True, (-64, 64)), ("u8", False, (0, 255)), ("u8", True, (0, 127))],
)
def test_the_gemm_weights_span_the_quantizers_range_for_the_plan(weights, reduce_range, span):
    model = matmul_integer_model(64, 64, 64, weights, reduce_range)
    b = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "b"))  # (K, N)
    assert (int(b.min()), int(b.max())) == span


def test_fp32_matmul_graph_is_valid_and_computes_the_product():
    m, k, n = 8, 32, 16
    model = matmul_model(m, k, n)
    onnx.checker.check_model(model, full_check=True)
    b = onnx.numpy_helper.to_array(model.graph.initializer[0])  # (K, N)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = np.random.default_rng(3).standard_normal((m, k), dtype=np.float32)  # (M, K)
    np.testing.assert_allclose(session.run(None, {"a": a})[0], a @ b, rtol=1e-4, atol=1e-4)


def test_a_bound_gemm_writes_the_product_into_its_own_buffer():
    m, k, n = 8, 32, 16
    plan = plan_int8(cpu_flags())
    model = matmul_integer_model(m, k, n, plan.weights, plan.reduce_range)
    b = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "b")).astype(np.int32)
    a = np.random.default_rng(4).integers(0, 256, size=(m, k), dtype=np.uint8)  # (M, K)
    call = BoundGemm.of(model, a.copy(), np.zeros((m, n), np.int32), threads=1)  # the call holds both buffers
    call()
    np.testing.assert_array_equal(call.y, (a.astype(np.int32) - INT8_ZERO_POINT) @ b)


def test_gemm_peaks_measures_every_library_and_precision():
    peaks = gemm_peaks(threads=1, shapes=((32, 64, 16), (16, 32, 64)), repeats=2, settle_s=0.0)
    assert peaks.fp32_gflops > 0 and peaks.int8_gops > 0 and peaks.fp32_ort_gflops > 0
    assert math.isclose(peaks.int8_over_fp32, peaks.int8_gops / peaks.fp32_gflops)
    assert math.isclose(peaks.int8_over_fp32_ort, peaks.int8_gops / peaks.fp32_ort_gflops)


def test_quick_is_a_reduced_grid_that_keeps_the_bar_shapes():
    args = parse_args(["--quick", "--out", "somewhere"])
    assert args.quick and str(args.out) == "somewhere" and args.heads is None
    assert parse_args(["--heads", "8"]).heads == (8,) and parse_args(["--heads", "1,16"]).heads == (1, 16)
    for bad in ("0", "eight", ""):
        with pytest.raises(SystemExit):
            parse_args(["--heads", bad])
    assert {1, 16} <= set(QUICK.heads) and 8 in QUICK.batches and 512 in QUICK.tokens  # h=16 vs h=1 at 8 x 512
    assert QUICK.repeats < 5


@pytest.mark.slow
def test_a_tiny_run_reports_int8_rows_and_the_int8_peak(tmp_path):
    """Export, quantize and time a tiny model end to end: every shape has all four runners, int8 included."""
    tiny = {"d_model": 32, "layers": 2, "max_len": 16, "repeats": 1, "gemm_shapes": ((64, 64, 64),)}
    cfg = BenchConfig(heads=(1, 2), batches=(2,), tokens=(8, 16), **tiny)
    plan = Int8Plan("s8", False, "test")
    lines: list[str] = []
    timings, peaks = run(cfg, plan, lines.append)
    assert peaks.fp32_gflops > 0 and peaks.int8_gops > 0 and peaks.fp32_ort_gflops > 0
    assert any(line.startswith("int8 GEMM peak (ORT MatMulInteger, u8 x s8") for line in lines)
    assert sorted((t.heads, t.tokens, t.runner) for t in timings) == sorted(
        (h, tokens, runner) for h in cfg.heads for tokens in cfg.tokens for runner in RUNNERS
    )
    assert all(t.ms > 0 and t.gflops > 0 and t.batch == 2 for t in timings)
    # h=1 layers stay unfused, so only the projections become MatMulInteger; h=2 layers become QAttention
    assert any(line.startswith("h=1: int8 graph: 0 QAttention, ") for line in lines)
    assert any(line.startswith("h=2: int8 graph: 2 QAttention, ") for line in lines)
    summary = summarize(timings, peaks, plan)
    assert len(summary["int8_vs_fused"]) == 4 and all(v > 0 for v in summary["int8_vs_fused"].values())
    assert summary["int8_vs_fused_geomean"] > 0 and summary["best_int8_vs_int8_peak"] > 0
    assert summary["int8_peak_vs_fp32_peak"] > 0
    assert all("n/a" not in row for row in report.table(timings).splitlines())
    paths = report.write(tmp_path, {"d_model": 32, "layers": 2}, {}, timings, summary)
    record = json.loads(paths[1].read_text())
    assert record["summary"]["int8_gemm_peak_gops"] == peaks.int8_gops
    assert sum(t["runner"] == "ort-int8" for t in record["timings"]) == 4
