"""Kernel benchmark: torch eager, the unfused and the fused ONNX graph in ONNX Runtime, per head count and shape.

`python -m benchmarks.kernel [--quick] [--out DIR]` prints a table and the ratios of issue 14's bar, and writes
kernel_bench.csv, kernel_bench.json and kernel_bench.png; GFLOP/s are set against a GEMM peak measured in the run."""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks import kernel_report
from contract.metadata import ATTENTION_MASK, INPUT_IDS, MODEL_FILE
from export.convert import export_model, exporter_versions
from export.model import EncoderClassifier, EncoderConfig
from service.runtime import session_options

RUNNERS = ("torch", "ort-unfused", "ort-fused")  # torch eager; today's graph and the fused one in ONNX Runtime
BAR_HEADS = (1, 8, 16)  # the head counts the bar's per-shape and geometric-mean ratios are taken over
GEMM_SHAPES = ((2048, 2048, 2048), (4096, 512, 2048), (4096, 2048, 512))  # (M, K, N): square, and the model's MLP
SAMPLE_S, SAMPLE_CALLS = 0.05, 100  # a timed sample repeats a short call to last about 50 ms (at most 100 calls)
SETTLE_S = 0.1  # pause before a sample: ORT's idle threads spin for a while and slowed the next runner down
OUT = Path("runs/kernel-bench")


@dataclass(frozen=True)
class BenchConfig:
    heads: tuple[int, ...] = (1, 2, 4, 8, 16)
    batches: tuple[int, ...] = (1, 8, 32)
    tokens: tuple[int, ...] = (32, 128, 512)
    d_model: int = 512
    layers: int = 4
    max_len: int = 512
    threads: int = 2  # torch threads and ORT intra-op threads
    repeats: int = 5  # timed samples per runner and shape, interleaved across the runners
    seed: int = 0


QUICK = BenchConfig(heads=(1, 16), batches=(1, 8), tokens=(32, 512), repeats=3)


@dataclass(frozen=True)
class Timing:
    heads: int
    batch: int
    tokens: int
    runner: str
    ms: float  # median latency of one forward pass
    gflops: float


def forward_flops(config: EncoderConfig, batch: int, tokens: int) -> int:
    """2 x multiply-adds of one forward pass: QKV and output projections, q k^T and weights v, the MLP.

    Embeddings, layer norms, softmax and the classifier head are left out (under 1 % at these sizes)."""
    inner = config.heads * config.resolved_head_dim
    per_token = 2 * config.d_model * 4 * inner + 2 * 2 * config.d_model * config.resolved_ff_dim
    attention = 2 * 2 * tokens * inner  # per query token: scores over `tokens` keys, then the weighted values
    return config.layers * batch * tokens * (per_token + attention)


def gemm_peak(threads: int, repeats: int = 5) -> float:
    """The best fp32 GFLOP/s of torch.matmul on GEMM_SHAPES with `threads` threads, measured now (best call)."""
    torch.set_num_threads(threads)
    best = 0.0
    with torch.inference_mode():
        for m, k, n in GEMM_SHAPES:
            a, b = torch.randn(m, k), torch.randn(k, n)
            a @ b  # warm-up
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = max(best, 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return best


def time_interleaved(
    calls: dict[str, Callable[..., object]], args: tuple, repeats: int, settle_s: float = SETTLE_S
) -> dict[str, float]:
    """Median ms of each `call(*args)`. Samples go round-robin, so that all calls share the machine's drift; each
    starts after a pause and one untimed call, so that no call pays for the still-spinning threads of the last."""
    warm = []
    for call in calls.values():
        start = time.perf_counter()
        call(*args)
        warm.append(time.perf_counter() - start)
    per_sample = min(SAMPLE_CALLS, max(1, round(SAMPLE_S / max(min(warm), 1e-9))))  # short calls: several
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            time.sleep(settle_s)
            call(*args)  # untimed: wakes this runner's threads
            start = time.perf_counter()
            for _ in range(per_sample):
                call(*args)
            samples[name].append((time.perf_counter() - start) / per_sample * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def _session(path: Path, threads: int) -> ort.InferenceSession:
    """With the service replica's own session options: the bench times what is served."""
    return ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])


def _model_runners(config: EncoderConfig, folder: Path, threads: int) -> dict[str, Callable]:
    """(ids, mask) -> logits callables for the torch model and its two exported graphs."""
    model = EncoderClassifier(config).eval()
    meta = config.metadata(exporter_versions())
    unfused = export_model(model, meta, folder / "unfused", fuse_attention=False).folder / MODEL_FILE
    fused = export_model(model, meta, folder / "fused").folder / MODEL_FILE
    sessions = {"ort-unfused": _session(unfused, threads), "ort-fused": _session(fused, threads)}

    def eager(ids: np.ndarray, mask: np.ndarray):
        with torch.inference_mode():
            return model(torch.from_numpy(ids), torch.from_numpy(mask))

    def onnx(session: ort.InferenceSession) -> Callable:
        return lambda ids, mask: session.run(None, {INPUT_IDS: ids, ATTENTION_MASK: mask})

    return {"torch": eager, **{name: onnx(session) for name, session in sessions.items()}}


def bench_heads(cfg: BenchConfig, h: int, folder: Path, log: Callable[[str], None]) -> list[Timing]:
    """Every shape of the grid for one head count."""
    torch.manual_seed(cfg.seed)
    config = EncoderConfig(d_model=cfg.d_model, heads=h, layers=cfg.layers, max_len=cfg.max_len)
    log(f"h={h}: exporting the unfused and the fused graph (parity gate included)")
    runners = _model_runners(config, folder / f"h{h}", cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    timings = []
    for batch in cfg.batches:
        for tokens in cfg.tokens:
            ids = rng.integers(4, config.vocab_size, size=(batch, tokens), dtype=np.int64)  # (B, T)
            mask = np.ones((batch, tokens), dtype=np.int64)  # (B, T): full-length rows
            ms = time_interleaved(runners, (ids, mask), cfg.repeats)
            flops = forward_flops(config, batch, tokens)
            timings += [Timing(h, batch, tokens, name, ms[name], flops / ms[name] / 1e6) for name in RUNNERS]
            log(f"h={h} {batch}x{tokens}: " + "  ".join(f"{name} {ms[name]:.1f} ms" for name in RUNNERS))
    return timings


def run(cfg: BenchConfig, log: Callable[[str], None]) -> tuple[list[Timing], float]:
    """All timings and the GEMM peak (GFLOP/s) measured before them."""
    torch.set_num_threads(cfg.threads)
    peak = gemm_peak(cfg.threads)
    log(f"fp32 GEMM peak (torch.matmul, {cfg.threads} threads): {peak:.0f} GFLOP/s")
    timings = []
    with tempfile.TemporaryDirectory(prefix="kernel-bench-") as tmp:
        for h in cfg.heads:
            timings += bench_heads(cfg, h, Path(tmp), log)
    return timings, peak


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


def summarize(timings: list[Timing], peak: float) -> dict[str, object]:
    """The ratios issue 14's bar names, from one run's timings; absent shapes or head counts give NaN."""
    index = _by_key(timings)
    all_heads = tuple(sorted({t.heads for t in timings}))
    bar_heads = tuple(h for h in BAR_HEADS if h in all_heads)
    fused = speedups(timings, "ort-fused", "torch", bar_heads)
    best = max((t for t in timings if t.runner == "ort-fused"), key=lambda t: t.gflops)

    def h16_over_h1(runner: str) -> float:
        pair = [index.get((h, 8, 512, runner)) for h in (16, 1)]
        return pair[0].ms / pair[1].ms if all(pair) else float("nan")

    summary = {
        "gemm_peak_gflops": peak,
        "fused_vs_torch": fused,
        "fused_vs_torch_min": min(fused.values(), default=float("nan")),
        "fused_vs_torch_geomean": geomean(list(fused.values())),
        "unfused_vs_torch_geomean": geomean(list(speedups(timings, "ort-unfused", "torch", bar_heads).values())),
        "fused_vs_unfused_geomean": geomean(list(speedups(timings, "ort-fused", "ort-unfused", all_heads).values())),
        "best_fused": {"shape": f"h{best.heads} {best.batch}x{best.tokens}", "gflops": best.gflops},
        "best_fused_vs_peak": best.gflops / peak,
        "h16_over_h1_8x512": {runner: h16_over_h1(runner) for runner in RUNNERS},
    }
    summary["bar"] = {
        "ORT never slower than torch (h 1, 8, 16)": summary["fused_vs_torch_min"] >= 1.0,
        "geometric mean >= 1.2x torch": summary["fused_vs_torch_geomean"] >= 1.2,
        "best shape within 20% of the GEMM peak": summary["best_fused_vs_peak"] >= 0.8,
        "8x512: h=16 within 10% of h=1": summary["h16_over_h1_8x512"]["ort-fused"] <= 1.1,
    }
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a reduced grid and repeats: {_grid(QUICK)}")
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for the CSV, JSON and plot (default {OUT})")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per runner and shape")
    return parser.parse_args(argv)


def _grid(cfg: BenchConfig) -> str:
    return f"h {','.join(map(str, cfg.heads))}; batch {cfg.batches} x tokens {cfg.tokens}; {cfg.repeats} repeats"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else BenchConfig()
    if args.repeats is not None:
        if args.repeats < 1:
            print(f"error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
            return 2
        cfg = replace(cfg, repeats=args.repeats)
    print(f"kernel bench: {_grid(cfg)}; d_model {cfg.d_model}, {cfg.layers} layers, {cfg.threads} threads", flush=True)
    timings, peak = run(cfg, lambda line: print(line, file=sys.stderr, flush=True))
    summary = summarize(timings, peak)
    machine = {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
    }
    paths = kernel_report.write(args.out, asdict(cfg), machine, timings, summary)
    print(kernel_report.table(timings))
    print(kernel_report.ratios(summary))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
