"""The decoder's attention kernel on CPU: the same decoder exported with ONNX `Attention` nodes (opset 23, the export's
default) and unfused (opset 20: MatMul, Softmax, MatMul), timed through ONNX Runtime at prefill and decode shapes in
interleaved rounds. Prints a Markdown table (median ms per run, fused / plain).

    python -m benchmarks.decoder_kernel [--d-model 256 --heads 8 --kv-heads 8,2 --layers 4 --rounds 5 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from export.decoder import DecoderConfig, DecoderLM
from export.decoder_export import export_decoder

SHAPES = [("prefill", 1, 128, 0), ("prefill", 8, 128, 0), ("decode", 1, 1, 256), ("decode", 8, 1, 256)]


def feeds(meta, batch: int, seq: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {
        "input_ids": rng.integers(4, meta.vocab_size, (batch, seq), dtype=np.int64),
        "attention_mask": np.ones((batch, past + seq), np.int64),
        "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),
    }
    cache = rng.standard_normal((batch, meta.kv_heads, past, meta.head_dim)).astype(np.float32)
    out.update({name: cache for name in meta.input_names[3:]})
    return out


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def time_run(sess: ort.InferenceSession, inputs: dict[str, np.ndarray], seconds: float = 0.5) -> float:
    sess.run(None, inputs)  # warm-up
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        sess.run(None, inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decoder_kernel", description=__doc__)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", default="8,2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kv in [int(k) for k in args.kv_heads.split(",")]:
            torch.manual_seed(0)
            config = DecoderConfig(d_model=args.d_model, heads=args.heads, kv_heads=kv, layers=args.layers, max_len=512)
            model = DecoderLM(config)
            sessions = {}
            for fused in (False, True):
                result = export_decoder(
                    model, config.metadata(), Path(tmp) / ("fused" if fused else "plain"), fuse_attention=fused
                )
                sessions[fused] = (session(result.folder / "model.onnx", args.threads), result.metadata)
            for phase, batch, seq, past in SHAPES:
                medians = {False: [], True: []}
                for _ in range(args.rounds):  # interleaved: both graphs share each round's machine state
                    for fused, (sess, meta) in sessions.items():
                        medians[fused].append(time_run(sess, feeds(meta, batch, seq, past)))
                plain, fused = statistics.median(medians[False]), statistics.median(medians[True])
                rows.append((config.name, f"{phase} {batch} x {seq}, past {past}", plain, fused, fused / plain))
    print("| model | shape | plain (ms) | onnx.Attention (ms) | fused / plain |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, shape, plain, fused, ratio in rows:
        print(f"| {name} | {shape} | {plain:.3f} | {fused:.3f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
