"""Kernel benchmark: torch eager, the unfused, fused and int8 ONNX graphs in ONNX Runtime, per head count and shape.

`python -m benchmarks.kernel [--quick] [--heads 8] [--out DIR]` prints a table and the ratios of issue 14's bar, and
writes kernel_bench.csv, kernel_bench.json and kernel_bench.png. GFLOP/s are set against an fp32 GEMM peak, and the
int8 graph's useful GOP/s (the fp32 FLOP count over its time) against an int8 GEMM peak, both measured in the run."""

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
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from benchmarks import kernel_report
from contract.metadata import ATTENTION_MASK, INPUT_IDS, MODEL_FILE
from export.convert import export_model, exporter_versions
from export.model import EncoderClassifier, EncoderConfig
from export.quantize import Int8Plan, cpu_flags, plan_int8, to_int8
from service.runtime import session_options

# torch eager; the unfused graph, the fused one (model.onnx, what is served) and its int8 variant in ONNX Runtime
RUNNERS = ("torch", "ort-unfused", "ort-fused", "ort-int8")
BAR_HEADS = (1, 8, 16)  # the head counts the bar's per-shape and geometric-mean ratios are taken over
GEMM_SHAPES = ((2048, 2048, 2048), (4096, 512, 2048), (4096, 2048, 512))  # (M, K, N): square, and the model's MLP
PEAK_REPEATS = 5  # timed calls per GEMM shape and precision; a peak is the best call
INT8_ZERO_POINT = 128  # the u8 activations' zero point, as dynamic quantization feeds MatMulInteger one
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
    gemm_shapes: tuple[tuple[int, int, int], ...] = GEMM_SHAPES  # (M, K, N) of the fp32 and int8 peaks


QUICK = BenchConfig(heads=(1, 16), batches=(1, 8), tokens=(32, 512), repeats=3)


@dataclass(frozen=True)
class Timing:
    heads: int
    batch: int
    tokens: int
    runner: str
    ms: float  # median latency of one forward pass
    gflops: float  # forward_flops / ms; for ort-int8 the same count: useful int8 GOP/s


@dataclass(frozen=True)
class Peaks:
    """The GEMM peaks of one run, measured interleaved on the same threads; 2*M*N*K operations per call."""

    fp32_gflops: float  # torch.matmul, fp32: the bar's reference
    int8_gops: float  # ORT MatMulInteger, u8 activations x the plan's weights, int32 out
    # ORT MatMul, fp32: the library the graphs run in. Torch's GEMM (MKL) can be far slower (half of ORT's on an AMD
    # EPYC), so this is the reference that says what int8 gains over fp32 within ORT.
    fp32_ort_gflops: float = float("nan")

    @property
    def int8_over_fp32(self) -> float:
        return self.int8_gops / self.fp32_gflops

    @property
    def int8_over_fp32_ort(self) -> float:
        return self.int8_gops / self.fp32_ort_gflops


def forward_flops(config: EncoderConfig, batch: int, tokens: int) -> int:
    """2 x multiply-adds of one forward pass: QKV and output projections, q k^T and weights v, the MLP.

    Embeddings, layer norms, softmax and the classifier head are left out (under 1 % at these sizes)."""
    inner = config.heads * config.resolved_head_dim
    per_token = 2 * config.d_model * 4 * inner + 2 * 2 * config.d_model * config.resolved_ff_dim
    attention = 2 * 2 * tokens * inner  # per query token: scores over `tokens` keys, then the weighted values
    return config.layers * batch * tokens * (per_token + attention)


def _gemm_model(op: str, a_type: int, y_type: int, m: int, k: int, n: int, constants: dict) -> onnx.ModelProto:
    """One `op` node: input "a" (M, K) times the constant "b" (K, N) (and any other constants), output "y" (M, N).

    The weights are an initializer, as in an exported model, so ORT may pack them once at session start."""
    graph = helper.make_graph(
        [helper.make_node(op, ["a", *constants], ["y"])],
        f"{op}_peak",
        [helper.make_tensor_value_info("a", a_type, [m, k])],
        [helper.make_tensor_value_info("y", y_type, [m, n])],
        initializer=[numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmul_integer_model(m: int, k: int, n: int, weights: str = "s8", seed: int = 0) -> onnx.ModelProto:
    """One MatMulInteger node: a (M, K) u8 input with a zero point, times constant (K, N) weights, (M, N) int32 out."""
    rng = np.random.default_rng(seed)
    if weights == "s8":
        b = rng.integers(-128, 128, size=(k, n), dtype=np.int8)  # (K, N)
    elif weights == "u8":
        b = rng.integers(0, 256, size=(k, n), dtype=np.uint8)  # (K, N)
    else:
        raise ValueError(f"weights must be 's8' or 'u8', got {weights!r}")
    constants = {"b": b, "a_zero_point": np.array(INT8_ZERO_POINT, dtype=np.uint8)}
    return _gemm_model("MatMulInteger", TensorProto.UINT8, TensorProto.INT32, m, k, n, constants)


def matmul_model(m: int, k: int, n: int, seed: int = 0) -> onnx.ModelProto:
    """One fp32 MatMul node: a (M, K) input times constant (K, N) weights, (M, N) out."""
    b = np.random.default_rng(seed).standard_normal((k, n), dtype=np.float32)  # (K, N)
    return _gemm_model("MatMul", TensorProto.FLOAT, TensorProto.FLOAT, m, k, n, {"b": b})


@dataclass(frozen=True)
class BoundGemm:
    """A call of a single-node GEMM graph on `a`, writing into `y`: session.run would copy the result every call.
    It holds `a` and `y`, since ORT's binding only points at their memory."""

    session: ort.InferenceSession
    binding: ort.IOBinding
    a: np.ndarray
    y: np.ndarray

    @classmethod
    def of(cls, model: onnx.ModelProto, a: np.ndarray, y: np.ndarray, threads: int) -> BoundGemm:
        options = session_options(threads)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        binding = session.io_binding()
        binding.bind_cpu_input("a", a)
        binding.bind_output("y", "cpu", 0, y.dtype, list(y.shape), y.ctypes.data)
        return cls(session, binding, a, y)

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.binding)


def gemm_peaks(
    threads: int,
    weights: str = "s8",
    shapes: tuple[tuple[int, int, int], ...] = GEMM_SHAPES,
    repeats: int = PEAK_REPEATS,
    settle_s: float = SETTLE_S,
) -> Peaks:
    """The best GFLOP/s (GOP/s) of torch.matmul, ORT's fp32 MatMul and ORT's MatMulInteger on `shapes`, `threads`
    threads each, measured now (best call). The three take turns call by call, so that all see the same drift; each
    call follows a pause, so that none pays for the last one's still-spinning threads."""
    torch.set_num_threads(threads)
    best = {"torch": 0.0, "ort-fp32": 0.0, "ort-int8": 0.0}
    with torch.inference_mode():
        for m, k, n in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)  # (M, K), (K, N)
            a8 = np.random.default_rng(seed=1).integers(0, 256, size=(m, k), dtype=np.uint8)  # (M, K)
            calls = {
                "torch": lambda a=a, b=b: a @ b,
                "ort-fp32": BoundGemm.of(matmul_model(m, k, n), a.numpy(), np.empty((m, n), np.float32), threads),
                "ort-int8": BoundGemm.of(
                    matmul_integer_model(m, k, n, weights), a8, np.empty((m, n), np.int32), threads
                ),
            }
            for call in calls.values():
                call()  # warm-up
            for _ in range(repeats):
                for name, call in calls.items():
                    time.sleep(settle_s)
                    start = time.perf_counter()
                    call()
                    best[name] = max(best[name], 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return Peaks(best["torch"], best["ort-int8"], best["ort-fp32"])


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


def op_counts(path: Path) -> dict[str, int]:
    """How many nodes of each op type the graph in `path` has."""
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def quantize_int8(fused: Path, folder: Path, plan: Int8Plan) -> Path:
    """The int8 variant of the fused graph, as `mha-serving quantize` makes it (dynamic mode, the plan), no gate."""
    folder.mkdir(parents=True, exist_ok=True)
    to_int8(fused, folder / MODEL_FILE, "dynamic", plan)
    return folder / MODEL_FILE


def _model_runners(
    config: EncoderConfig, folder: Path, threads: int, plan: Int8Plan, log: Callable[[str], None]
) -> dict[str, Callable]:
    """(ids, mask) -> logits callables for the torch model, its two exported graphs and the fused one in int8."""
    model = EncoderClassifier(config).eval()
    meta = config.metadata(exporter_versions())
    unfused = export_model(model, meta, folder / "unfused", fuse_attention=False).folder / MODEL_FILE
    fused = export_model(model, meta, folder / "fused").folder / MODEL_FILE
    int8 = quantize_int8(fused, folder / "int8", plan)
    ops = op_counts(int8)
    quantized = ", ".join(f"{ops.get(op, 0)} {op}" for op in ("QAttention", "MatMulInteger"))
    log(f"h={config.heads}: int8 graph: {quantized}")
    paths = {"ort-unfused": unfused, "ort-fused": fused, "ort-int8": int8}
    sessions = {name: _session(path, threads) for name, path in paths.items()}

    def eager(ids: np.ndarray, mask: np.ndarray):
        with torch.inference_mode():
            return model(torch.from_numpy(ids), torch.from_numpy(mask))

    def onnx_run(session: ort.InferenceSession) -> Callable:
        return lambda ids, mask: session.run(None, {INPUT_IDS: ids, ATTENTION_MASK: mask})

    return {"torch": eager, **{name: onnx_run(session) for name, session in sessions.items()}}


def bench_heads(cfg: BenchConfig, h: int, folder: Path, plan: Int8Plan, log: Callable[[str], None]) -> list[Timing]:
    """Every shape of the grid for one head count."""
    torch.manual_seed(cfg.seed)
    config = EncoderConfig(d_model=cfg.d_model, heads=h, layers=cfg.layers, max_len=cfg.max_len)
    log(f"h={h}: exporting the unfused and the fused graph (parity gate included), quantizing the fused one")
    runners = _model_runners(config, folder / f"h{h}", cfg.threads, plan, log)
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


def run(cfg: BenchConfig, plan: Int8Plan, log: Callable[[str], None]) -> tuple[list[Timing], Peaks]:
    """All timings and the GEMM peaks measured before them."""
    torch.set_num_threads(cfg.threads)
    peaks = gemm_peaks(cfg.threads, plan.weights, cfg.gemm_shapes)
    log(f"fp32 GEMM peak (torch.matmul, {cfg.threads} threads): {peaks.fp32_gflops:.0f} GFLOP/s")
    log(f"fp32 GEMM peak (ORT MatMul, {cfg.threads} threads): {peaks.fp32_ort_gflops:.0f} GFLOP/s")
    log(
        f"int8 GEMM peak (ORT MatMulInteger, u8 x {plan.weights}, {cfg.threads} threads): {peaks.int8_gops:.0f} GOP/s "
        f"= {peaks.int8_over_fp32:.2f}x torch's fp32 peak, {peaks.int8_over_fp32_ort:.2f}x ORT's"
    )
    timings = []
    with tempfile.TemporaryDirectory(prefix="kernel-bench-") as tmp:
        for h in cfg.heads:
            timings += bench_heads(cfg, h, Path(tmp), plan, log)
    return timings, peaks


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
    paths = kernel_report.write(args.out, asdict(cfg), machine, timings, summary)
    print(kernel_report.table(timings))
    print(kernel_report.ratios(summary))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
