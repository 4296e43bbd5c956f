"""What the kernel benchmark writes: a Markdown table, the bar's and the int8 graph's ratios, CSV, JSON and one plot
(GFLOP/s per h, int8 in useful GOP/s, with the fp32 and the int8 GEMM peak)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.kernel.runs import Timing

CSV_FILE, JSON_FILE, PLOT_FILE = "kernel_bench.csv", "kernel_bench.json", "kernel_bench.png"
LABELS = {
    "torch": "torch eager",
    "ort-unfused": "ORT, unfused graph",
    "ort-fused": "ORT, fused attention",
    "ort-int8": "ORT, fused, int8 (useful GOP/s)",
}


def table(timings: list[Timing]) -> str:
    """One Markdown row per head count and shape; speed ratios are latency ratios (above 1: the first is faster).

    int8 GOP/s count the fp32 FLOPs of the forward pass: the useful work, whatever precision did it."""
    index = {(t.heads, t.batch, t.tokens, t.runner): t for t in timings}
    lines = [
        "| h | batch x tokens | torch ms | ORT unfused ms | ORT fused ms | ORT int8 ms | fused GFLOP/s | int8 GOP/s "
        "| fused vs torch | fused vs unfused | int8 vs fused |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in timings:
        if t.runner != "ort-fused":
            continue
        eager, unfused = index[t.heads, t.batch, t.tokens, "torch"], index[t.heads, t.batch, t.tokens, "ort-unfused"]
        int8 = index.get((t.heads, t.batch, t.tokens, "ort-int8"))
        int8_ms, int8_gops, int8_speedup = (
            (f"{int8.ms:.1f}", f"{int8.gflops:.0f}", f"{t.ms / int8.ms:.2f}x") if int8 else ("n/a",) * 3
        )
        lines.append(
            f"| {t.heads} | {t.batch} x {t.tokens} | {eager.ms:.1f} | {unfused.ms:.1f} | {t.ms:.1f} | {int8_ms} "
            f"| {t.gflops:.0f} | {int8_gops} | {eager.ms / t.ms:.2f}x | {unfused.ms / t.ms:.2f}x | {int8_speedup} |"
        )
    return "\n".join(lines)


def _num(value: float, unit: str = "x") -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}{unit}"


def ratios(summary: dict) -> str:
    """The bar's ratios as lines of text, each bar item with its verdict."""
    h16 = summary["h16_over_h1_8x512"]
    lines = [
        f"GEMM peak {summary['gemm_peak_gflops']:.0f} GFLOP/s; best fused shape {summary['best_fused']['shape']}: "
        f"{summary['best_fused']['gflops']:.0f} GFLOP/s = {_num(summary['best_fused_vs_peak'], '')} of peak "
        f"(ORT's fp32 MatMul peak {summary['ort_fp32_gemm_peak_gflops']:.0f} GFLOP/s: "
        f"{_num(summary['best_fused_vs_ort_fp32_peak'], '')} of it)",
        f"ORT fused vs torch (h 1, 8, 16): min {_num(summary['fused_vs_torch_min'])}, "
        f"geometric mean {_num(summary['fused_vs_torch_geomean'])} "
        f"(unfused: {_num(summary['unfused_vs_torch_geomean'])}); "
        f"fused vs unfused, all h: {_num(summary['fused_vs_unfused_geomean'])}",
        "8x512 latency, h=16 / h=1: " + ", ".join(f"{name} {_num(value)}" for name, value in h16.items()),
        f"int8 GEMM peak {summary['int8_gemm_peak_gops']:.0f} GOP/s = {_num(summary['int8_peak_vs_fp32_peak'])} "
        f"torch's fp32 peak, {_num(summary['int8_peak_vs_ort_fp32_peak'])} ORT's fp32 MatMul peak; "
        f"best int8 shape {summary['best_int8']['shape']}: "
        f"{summary['best_int8']['gflops']:.0f} useful GOP/s = {_num(summary['best_int8_vs_int8_peak'], '')} of the "
        "int8 peak",
        f"ORT int8 vs fp32 fused, all h: min {_num(summary['int8_vs_fused_min'])}, "
        f"geometric mean {_num(summary['int8_vs_fused_geomean'])}, max {_num(summary['int8_vs_fused_max'])}",
    ]
    verdicts = {True: "met", False: "NOT met", None: "not measured"}
    lines += [f"  [{verdicts[ok]}] {item}" for item, ok in summary["bar"].items()]
    return "\n".join(lines)


def write(out: Path, config: dict, machine: dict, timings: list[Timing], summary: dict) -> list[Path]:
    """kernel_bench.csv, .json and .png in `out` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(t) for t in timings]
    with (out / CSV_FILE).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    record = {"config": config, "machine": machine, "summary": summary, "timings": rows}
    (out / JSON_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    title = f"Forward pass GFLOP/s per head count (d_model {config['d_model']}, {config['layers']} layers)"
    peaks = {"fp32 GEMM peak, torch": summary["gemm_peak_gflops"]}
    peaks["fp32 GEMM peak, ORT"] = summary["ort_fp32_gemm_peak_gflops"]
    peaks["int8 GEMM peak (GOP/s)"] = summary["int8_gemm_peak_gops"]
    plot(timings, peaks, out / PLOT_FILE, title)
    return [out / CSV_FILE, out / JSON_FILE, out / PLOT_FILE]


def plot(timings: list[Timing], peaks: dict[str, float], path: Path, title: str) -> None:
    """One panel per batch x tokens shape: GFLOP/s against h for each runner (int8: useful GOP/s), each GEMM peak
    (label -> GFLOP/s or GOP/s) as a grey line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches, tokens = sorted({t.batch for t in timings}), sorted({t.tokens for t in timings})
    heads = sorted({t.heads for t in timings})
    size = (3.4 * len(tokens), 2.6 * len(batches))
    fig, axes = plt.subplots(len(batches), len(tokens), figsize=size, sharex=True, sharey=True, squeeze=False)
    for i, batch in enumerate(batches):
        for j, seq in enumerate(tokens):
            ax = axes[i][j]
            for runner, label in LABELS.items():
                shape = (batch, seq, runner)
                points = sorted((t.heads, t.gflops) for t in timings if (t.batch, t.tokens, t.runner) == shape)
                ax.plot([h for h, _ in points], [g for _, g in points], marker="o", label=label)
            for (label, peak), style in zip(peaks.items(), ("--", "-.", ":", (0, (1, 4))), strict=False):
                if not math.isnan(peak):
                    ax.axhline(peak, color="grey", linestyle=style, linewidth=1, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(heads, labels=[str(h) for h in heads], minor=False)
            ax.minorticks_off()
            ax.set_title(f"batch {batch} x {seq} tokens", fontsize=9)
            ax.set_xlabel("heads h")
            ax.set_ylabel("GFLOP/s, GOP/s")
            ax.label_outer()
    # One range for the shared axes, set once all panels are drawn: set_ylim(bottom=0) in the first panel would stop
    # autoscaling at that panel's top and hide the points above it in the others.
    tops = [t.gflops for t in timings] + [v for v in peaks.values() if not math.isnan(v)]
    axes[0][0].set_ylim(0, 1.05 * max(tops, default=1.0))
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend's two rows below the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)
