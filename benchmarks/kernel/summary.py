"""The kernel benchmark's ratios: issue 14's bar (ORT's fused graph against torch, against the GEMM peak, h=16
against h=1) and the int8 graph's, from one run's timings and peaks."""

from __future__ import annotations

import math
from dataclasses import asdict

from benchmarks.kernel.gemm import Peaks
from benchmarks.kernel.runs import RUNNERS, Timing
from export.quantize import Int8Plan

BAR_HEADS = (1, 8, 16)  # the head counts the bar's per-shape and geometric-mean ratios are taken over


def _by_key(timings: list[Timing]) -> dict[tuple[int, int, int, str], Timing]:
    return {(t.heads, t.batch, t.tokens, t.runner): t for t in timings}


def speedups(timings: list[Timing], runner: str, over: str, heads: tuple[int, ...]) -> dict[str, float]:
    """`over`'s latency / `runner`'s per shape (above 1: `runner` is faster), for the given head counts."""
    index = _by_key(timings)
    return {
        f"h{t.heads} {t.batch}x{t.tokens}": index[t.heads, t.batch, t.tokens, over].ms / t.ms
        for t in timings
        if t.runner == runner and t.heads in heads
    }


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _best(timings: list[Timing], runner: str) -> dict[str, object]:
    """The shape where `runner` does the most (useful) operations a second; NaN without such timings."""
    best = max((t for t in timings if t.runner == runner), key=lambda t: t.gflops, default=None)
    if best is None:
        return {"shape": "n/a", "gflops": float("nan")}
    return {"shape": f"h{best.heads} {best.batch}x{best.tokens}", "gflops": best.gflops}


def summarize(timings: list[Timing], peaks: Peaks, plan: Int8Plan | None = None) -> dict[str, object]:
    """The ratios issue 14's bar names and the int8 graph's, from one run's timings and peaks; absent shapes, head
    counts or runners give NaN."""
    index = _by_key(timings)
    all_heads = tuple(sorted({t.heads for t in timings}))
    bar_heads = tuple(h for h in BAR_HEADS if h in all_heads)
    fused = speedups(timings, "ort-fused", "torch", bar_heads)
    best = _best(timings, "ort-fused")
    int8 = speedups(timings, "ort-int8", "ort-fused", all_heads)  # fp32 fused latency / int8 latency, per shape
    best_int8 = _best(timings, "ort-int8")

    def h16_over_h1(runner: str) -> float:
        pair = [index.get((h, 8, 512, runner)) for h in (16, 1)]
        return pair[0].ms / pair[1].ms if all(pair) else float("nan")

    summary = {
        "gemm_peak_gflops": peaks.fp32_gflops,
        "fused_vs_torch": fused,
        "fused_vs_torch_min": min(fused.values(), default=float("nan")),
        "fused_vs_torch_geomean": geomean(list(fused.values())),
        "unfused_vs_torch_geomean": geomean(list(speedups(timings, "ort-unfused", "torch", bar_heads).values())),
        "fused_vs_unfused_geomean": geomean(list(speedups(timings, "ort-fused", "ort-unfused", all_heads).values())),
        "best_fused": best,
        "best_fused_vs_peak": best["gflops"] / peaks.fp32_gflops,
        "h16_over_h1_8x512": {runner: h16_over_h1(runner) for runner in RUNNERS},
        "ort_fp32_gemm_peak_gflops": peaks.fp32_ort_gflops,
        "int8_gemm_peak_gops": peaks.int8_gops,
        "int8_peak_vs_fp32_peak": peaks.int8_over_fp32,
        "int8_peak_vs_ort_fp32_peak": peaks.int8_over_fp32_ort,
        "best_fused_vs_ort_fp32_peak": best["gflops"] / peaks.fp32_ort_gflops,
        "int8_plan": asdict(plan) if plan else None,
        "int8_vs_fused": int8,
        "int8_vs_fused_min": min(int8.values(), default=float("nan")),
        "int8_vs_fused_max": max(int8.values(), default=float("nan")),
        "int8_vs_fused_geomean": geomean(list(int8.values())),
        "best_int8": best_int8,
        "best_int8_vs_int8_peak": best_int8["gflops"] / peaks.int8_gops,
    }
    summary["bar"] = {
        "ORT never slower than torch (h 1, 8, 16)": summary["fused_vs_torch_min"] >= 1.0,
        "geometric mean >= 1.2x torch": summary["fused_vs_torch_geomean"] >= 1.2,
        "best shape within 20% of the GEMM peak": summary["best_fused_vs_peak"] >= 0.8,
        "8x512: h=16 within 10% of h=1": summary["h16_over_h1_8x512"]["ort-fused"] <= 1.1,
    }
    # A figure of head counts or shapes the run did not measure (--heads) is NaN: no verdict rather than "not met".
    figures = (summary["fused_vs_torch_min"], summary["fused_vs_torch_geomean"], summary["best_fused_vs_peak"])
    for item, figure in zip(summary["bar"], (*figures, summary["h16_over_h1_8x512"]["ort-fused"]), strict=True):
        if math.isnan(figure):
            summary["bar"][item] = None
    return summary
