"""Kernel benchmark: torch eager, the unfused, fused and int8 ONNX graphs in ONNX Runtime, per head count and shape.
`python -m benchmarks.kernel [--quick] [--heads 8] [--out DIR]` prints a table and the ratios of issue 14's bar, and
writes kernel_bench.csv, kernel_bench.json and kernel_bench.png."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import asdict, replace
from pathlib import Path

import onnxruntime as ort
import torch

from benchmarks.kernel import report
from benchmarks.kernel.runs import QUICK, BenchConfig, run
from benchmarks.kernel.summary import summarize
from export.quantize import cpu_flags, plan_int8

OUT = Path("runs/kernel-bench")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a reduced grid and repeats: {_grid(QUICK)}")
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for the CSV, JSON and plot (default {OUT})")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per runner and shape")
    parser.add_argument(
        "--heads", type=_ints, default=None, help="head counts instead of the grid's, e.g. 8 (the default model)"
    )
    return parser.parse_args(argv)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _grid(cfg: BenchConfig) -> str:
    return f"h {','.join(map(str, cfg.heads))}; batch {cfg.batches} x tokens {cfg.tokens}; {cfg.repeats} repeats"


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else BenchConfig()
    if args.repeats is not None:
        if args.repeats < 1:
            print(f"error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
            return 2
        cfg = replace(cfg, repeats=args.repeats)
    if args.heads is not None:
        cfg = replace(cfg, heads=args.heads)
    plan = plan_int8(cpu_flags())
    print(f"kernel bench: {_grid(cfg)}; d_model {cfg.d_model}, {cfg.layers} layers, {cfg.threads} threads", flush=True)
    print(f"int8: dynamic quantization of the fused graph, weights {plan.weights}, {plan.reason}", flush=True)
    timings, peaks = run(cfg, plan, lambda line: print(line, file=sys.stderr, flush=True))
    summary = summarize(timings, peaks, plan)
    machine = {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),  # torch's and ORT's fp32 peaks differ by CPU vendor (MKL favours Intel's)
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
    }
    paths = report.write(args.out, asdict(cfg), machine, timings, summary)
    print(report.table(timings))
    print(report.ratios(summary))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
