"""A decoder and its precision variants on CPU: generated tokens per second of a plain greedy loop with the KV cache
(prefill a prompt of held-out text, then one token per step, present fed back as past), at several batch sizes, in
interleaved rounds. Prints a Markdown table: median tokens/s, and each variant against fp32 as the median of the rounds'
ratios (each round times every precision back to back, so a busy machine slows both sides of a ratio alike).

    python -m benchmarks.decoder_precision --model models/lm-h4-kv1-d64 [--precision int8 --batch 1,8 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.decoder_metadata import DecoderMetadata
from export import onnx_file
from export.docs_corpus import load_corpus
from export.quantize import variant_name


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path / "model.onnx"), options, providers=["CPUExecutionProvider"])


def greedy_seconds(sess: ort.InferenceSession, meta: DecoderMetadata, prompts: np.ndarray, new: int) -> float:
    """Seconds for `new` greedy tokens per row of `prompts` (B, T): one prefill and new - 1 decode steps."""
    batch, total = prompts.shape
    empty = np.zeros((batch, meta.kv_heads, 0, meta.head_dim), np.float32)
    past = {name: empty for name in meta.input_names[3:]}
    ids = prompts
    start = time.perf_counter()
    for _ in range(new):
        positions = np.tile(np.arange(total - ids.shape[1], total, dtype=np.int64), (batch, 1))
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, total), np.int64), "position_ids": positions}
        logits, *present = sess.run(None, {**feeds, **past})
        past = dict(zip(past, present, strict=True))
        ids, total = logits[:, -1].argmax(axis=-1)[:, None], total + 1  # (B, 1)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decoder_precision", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="an fp32 decoder folder; its variants beside it")
    parser.add_argument("--precision", default="int8", help="variants to compare (comma-separated)")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    meta = onnx_file.read_any_metadata(args.model / "model.onnx")
    folders = {"fp32": args.model}
    for precision in args.precision.split(","):
        folders[precision] = args.model.parent / variant_name(args.model.name, precision)
    sessions = {precision: session(folder, args.threads) for precision, folder in folders.items()}
    val = np.array(load_corpus().val.ids, dtype=np.int64)
    print("| model | batch | " + " | ".join(f"{p} (tokens/s)" for p in sessions) + " | variant / fp32 |")
    print("| --- | ---: |" + " ---: |" * len(sessions) + " ---: |")
    for batch in [int(b) for b in args.batch.split(",")]:
        starts = np.linspace(0, len(val) - args.prompt, batch, dtype=np.int64)
        prompts = np.stack([val[s : s + args.prompt] for s in starts])  # (B, T)
        times: dict[str, list[float]] = {p: [] for p in sessions}
        for _ in range(args.rounds):  # interleaved: every precision shares each round's machine state
            for precision, sess in sessions.items():
                times[precision].append(greedy_seconds(sess, meta, prompts, args.new))
        rates = {p: batch * args.new / statistics.median(t) for p, t in times.items()}
        paired = {p: statistics.median(f / v for f, v in zip(times["fp32"], t, strict=True)) for p, t in times.items()}
        ratios = ", ".join(f"{paired[p]:.2f}" for p in paired if p != "fp32")
        cells = " | ".join(f"{rate:,.0f}" for rate in rates.values())
        print(f"| {meta.name} | {batch} | {cells} | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
