"""The kernel benchmark's runs: per head count, the model in torch eager, its unfused and fused ONNX graphs and the
fused one in int8 (exported and quantized as the service's tools make them), timed on every shape of the grid."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from benchmarks.kernel.gemm import GEMM_SHAPES, Peaks, gemm_peaks
from benchmarks.kernel.timing import time_interleaved
from contract.metadata import ATTENTION_MASK, INPUT_IDS, MODEL_FILE
from export.convert import export_model, exporter_versions
from export.model import EncoderClassifier, EncoderConfig
from export.quantize import Int8Plan, to_int8
from service.runtime import session_options

# torch eager; the unfused graph, the fused one (model.onnx, what is served) and its int8 variant in ONNX Runtime
RUNNERS = ("torch", "ort-unfused", "ort-fused", "ort-int8")


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


def forward_flops(config: EncoderConfig, batch: int, tokens: int) -> int:
    """2 x multiply-adds of one forward pass: QKV and output projections, q k^T and weights v, the MLP.

    Embeddings, layer norms, softmax and the classifier head are left out (under 1 % at these sizes)."""
    inner = config.heads * config.resolved_head_dim
    per_token = 2 * config.d_model * 4 * inner + 2 * 2 * config.d_model * config.resolved_ff_dim
    attention = 2 * 2 * tokens * inner  # per query token: scores over `tokens` keys, then the weighted values
    return config.layers * batch * tokens * (per_token + attention)


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
    peaks = gemm_peaks(cfg.threads, plan, cfg.gemm_shapes)
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
