"""Backend report: which provider each model really runs on, GPU-vs-CPU parity, and latency per h on each backend.

`python -m benchmarks.backend_report --models models/ --backend gpu` (no Ray needed). A measurement, not a test.
No torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from service.errors import BackendError, ModelFileError
from service.model_store import find_models
from service.runtime import Runtime, load_runtime


def padded_batch(rt: Runtime, batch: int, seq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random ids (B, T) with row i padded after seq - i tokens (at least 1), and its mask."""
    rng = np.random.default_rng(seed + batch * 1000 + seq)
    ids = rng.integers(4, rt.meta.vocab_size, size=(batch, seq), dtype=np.int64)  # (B, T)
    mask = np.ones((batch, seq), dtype=np.int64)  # (B, T)
    for row in range(1, batch):
        keep = max(1, seq - row)
        ids[row, keep:], mask[row, keep:] = 0, 0
    return ids, mask


def p50_ms(rt: Runtime, ids: np.ndarray, mask: np.ndarray, repeats: int) -> float:
    for _ in range(3):  # warm-up: first runs allocate and (on CUDA) pick kernels
        rt.run(ids, mask)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rt.run(ids, mask)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def report_model(models_dir: Path, name: str, backend: str, shapes: list[tuple[int, int]], threads: int, repeats: int):
    rt = load_runtime(models_dir, name, backend, threads)
    cpu = rt if rt.backend == "cpu" else load_runtime(models_dir, name, "cpu", threads)
    row = {
        "model": name,
        "heads": rt.meta.heads,
        "head_dim": rt.meta.head_dim,
        "backend": rt.backend,
        "providers": rt.session.get_providers(),
        "reason": rt.reason,
        "max_diff_vs_cpu": 0.0,
        "latency": [],
    }
    for batch, seq in shapes:
        seq = min(seq, rt.meta.max_len)
        ids, mask = padded_batch(rt, batch, seq)
        diff = float(np.abs(rt.run(ids, mask) - cpu.run(ids, mask)).max())
        row["max_diff_vs_cpu"] = max(row["max_diff_vs_cpu"], diff)
        ms = p50_ms(rt, ids, mask, repeats)
        cpu_ms = ms if cpu is rt else p50_ms(cpu, ids, mask, max(3, repeats // 4))
        row["latency"].append(
            {"batch": batch, "seq": seq, "p50_ms": ms, "cpu_p50_ms": cpu_ms, "seqs_per_s": batch / (ms / 1e3)}
        )
    return row


def print_table(rows: list[dict]) -> None:
    print(
        f"{'model':<18} {'h':>3} {'hd':>4} {'backend':<7} {'batch':>5} {'seq':>4} {'p50 ms':>8} "
        f"{'cpu p50 ms':>10} {'seq/s':>9} {'max diff':>9}"
    )
    for r in rows:
        for lat in r["latency"]:
            print(
                f"{r['model']:<18} {r['heads']:>3} {r['head_dim']:>4} {r['backend']:<7} {lat['batch']:>5} "
                f"{lat['seq']:>4} {lat['p50_ms']:>8.3f} {lat['cpu_p50_ms']:>10.3f} {lat['seqs_per_s']:>9.0f} "
                f"{r['max_diff_vs_cpu']:>9.2e}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backend_report", description=__doc__)
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--shapes", default="1x32,8x128,32x32,32x128", help="BATCHxSEQ,... (seq capped at max_len)")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads on CPU")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        names = find_models(args.models)
        rows = [report_model(args.models, n, args.backend, shapes, args.threads, args.repeats) for n in names]
    except (ValueError, ModelFileError, BackendError) as exc:
        print(f"backend_report: {exc}", file=sys.stderr)
        return 1
    for r in rows:
        print(f"{r['model']}: backend {r['backend']} (providers {r['providers']}): {r['reason']}")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
