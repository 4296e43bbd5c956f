"""The kernel benchmark's pure parts: FLOP counting, the bar's ratios, interleaved timing, the report files.
No timed assertions: the bench itself runs by hand (`python -m benchmarks.kernel`)."""

from __future__ import annotations

import json
import math

from benchmarks import kernel_report
from benchmarks.kernel import QUICK, RUNNERS, Timing, forward_flops, geomean, parse_args, summarize, time_interleaved
from export.model import EncoderConfig


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
    summary = summarize(_timings(ms), peak=3.0)
    assert summary["fused_vs_torch"] == {"h1 8x512": 1.5, "h16 8x512": 1.5}
    assert summary["fused_vs_torch_min"] == 1.5 and math.isclose(summary["fused_vs_torch_geomean"], 1.5)
    assert math.isclose(summary["h16_over_h1_8x512"]["ort-fused"], 420 / 400)
    assert summary["best_fused"]["shape"] == "h1 8x512" and math.isclose(summary["best_fused_vs_peak"], 2.5 / 3.0)
    assert all(summary["bar"].values())
    assert math.isclose(geomean([1.0, 4.0]), 2.0) and math.isnan(geomean([]))


def test_time_interleaved_gives_every_call_a_median_and_runs_each_repeatedly():
    counts = {"a": 0, "b": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    ms = time_interleaved({"a": bump, "b": bump}, ("a",), repeats=3, settle_s=0.0)
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
    assert counts["a"] >= 2 * (1 + 3 * 2) and counts["b"] == 0  # both got ("a",): warm-up, then untimed + timed


def test_report_table_ratios_and_files(tmp_path):
    ms = {(h, runner): value for h in (1, 16) for runner, value in zip(RUNNERS, (300.0, 250.0, 200.0), strict=True)}
    timings = _timings(ms)
    summary = summarize(timings, peak=10.0)
    table = kernel_report.table(timings).splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| 1 | 8 x 512 | 300.0 | 250.0 | 200.0 |")
    assert "1.50x | 1.25x |" in table[2]
    assert "[met] ORT never slower than torch" in kernel_report.ratios(summary)
    config = {"d_model": 512, "layers": 4}
    paths = kernel_report.write(tmp_path / "out", config, {"cpus": 2}, timings, summary)
    assert [p.name for p in paths] == ["kernel_bench.csv", "kernel_bench.json", "kernel_bench.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    record = json.loads(paths[1].read_text())
    assert len(record["timings"]) == 6 and record["summary"]["fused_vs_torch_min"] == 1.5
    assert paths[0].read_text().splitlines()[0] == "heads,batch,tokens,runner,ms,gflops"


def test_quick_is_a_reduced_grid_that_keeps_the_bar_shapes():
    args = parse_args(["--quick", "--out", "somewhere"])
    assert args.quick and str(args.out) == "somewhere"
    assert {1, 16} <= set(QUICK.heads) and 8 in QUICK.batches and 512 in QUICK.tokens  # h=16 vs h=1 at 8 x 512
    assert QUICK.repeats < 5
