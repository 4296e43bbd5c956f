"""`mha-serving prune-curve`: accuracy and latency against the fraction of heads pruned, for one trained model.

Heads are removed one at a time in importance order (re-scored after each removal, on the run's validation split)
and in random order (several seeds); accuracy is measured on fresh examples of the task that neither training nor
scoring saw; each importance-order model is exported through the normal path (parity gate) and timed with ONNX
Runtime in-process at batch 1 and 32, all models in interleaved rounds. Writes curve.md, .csv, .json and .png.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path
from statistics import mean, pstdev

import torch

from export.checkpoint import CheckpointError, load_checkpoint
from export.convert import ExportError, export_model, exporter_versions
from export.importance import heads_per_layer, run_splits
from export.parity import ParityError
from export.prune import PruneError, finetune, iterative_prune
from export.prune_curve_report import CurveRow, write_report
from export.staging import staged_folder
from export.sweep import LATENCY_SEED
from export.sweep_timing import TimingError, in_process_caller, time_models
from export.tasks import get_task
from export.train import TrainConfig, encode_examples, evaluate

TEST_SEED_OFFSET = 1_000_003  # the test examples' seed: the run's seed plus this (never a training or scoring seed)
TEST_EXAMPLES = 2000


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mha-serving prune-curve", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    parser.add_argument("--seeds", type=int, default=3, help="random orders to compare with (default %(default)s)")
    parser.add_argument("--finetune-steps", type=int, default=0, help="AdamW steps after each pruning (default none)")
    parser.add_argument("--finetune-lr", type=float, default=3e-4, help="constant fine-tuning lr (%(default)s)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls at batch 1 (batch 32: a quarter)")
    parser.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads (%(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/prune-curve-<model>)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.repeats < 1 or args.finetune_steps < 0 or args.finetune_lr <= 0:
        raise PruneError("need --seeds >= 1, --repeats >= 1, --finetune-steps >= 0 and --finetune-lr > 0")
    return args


def _accuracies(args, checkpoint, order: str, seed: int, counts: list[int], train, val, test) -> dict[int, float]:
    """Heads removed -> test accuracy, pruning in `order` (after fine-tuning, with --finetune-steps)."""
    found = iterative_prune(checkpoint.model, val, counts, order, seed)
    out = {}
    for n, pruned in found.items():
        model = finetune(pruned.model, train, args.finetune_steps, args.finetune_lr, seed=seed) if n else pruned.model
        out[n] = evaluate(model, test)[1]
    return out


def _latency(args, checkpoint, val, counts: list[int], scratch: Path) -> tuple[dict, dict[int, str]]:
    """Heads removed -> p50 ms at batch 1 and 32 of the importance-order model, exported and timed in ORT; and
    heads removed -> the exported graph's attention kernel."""
    found = iterative_prune(checkpoint.model, val, counts, "importance")
    task = get_task(checkpoint.model.config.task)
    texts = [e.text for e in task.generate(64, LATENCY_SEED)]
    callers, kernels = {}, {}
    for n, pruned in found.items():
        exported = export_model(pruned.model, pruned.model.config.metadata(exporter_versions()), scratch)
        callers[n] = in_process_caller(exported.folder, texts, task.max_len, args.threads)
        kernels[n] = exported.metadata.attention_kernel
        print(f"  exported {exported.name} ({n} head(s) removed, {kernels[n]}) for timing", flush=True)
    return time_models(callers, args.repeats), kernels


def curve(args: argparse.Namespace, checkpoint) -> list[CurveRow]:
    layer_heads = heads_per_layer(checkpoint.model)
    total, counts = sum(layer_heads), list(range(sum(layer_heads) - len(layer_heads) + 1))  # 0 .. every layer at 1
    config = TrainConfig(**checkpoint.training)  # type: ignore[arg-type]
    train, val = run_splits(checkpoint)
    test = encode_examples(get_task(config.task), TEST_EXAMPLES, config.seed + TEST_SEED_OFFSET)
    print(f"importance order: {len(counts) - 1} removals, re-scored after each", flush=True)
    ranked = _accuracies(args, checkpoint, "importance", 0, counts, train, val, test)
    randoms = []
    for seed in range(args.seeds):
        print(f"random order, seed {seed}", flush=True)
        randoms.append(_accuracies(args, checkpoint, "random", seed, counts, train, val, test))
    print(f"timing {len(counts)} models in-process ({args.threads} ORT thread(s))", flush=True)
    with tempfile.TemporaryDirectory(prefix=".prune-curve.") as scratch:
        latency, kernels = _latency(args, checkpoint, val, counts, Path(scratch))
    rows = []
    for n in counts:
        accs = [r[n] for r in randoms]
        rows.append(
            CurveRow(
                removed=n,
                fraction=n / total,
                heads_kept=total - n,
                acc_importance=ranked[n],
                acc_random_mean=mean(accs),
                acc_random_std=pstdev(accs),
                p50_b1_ms=latency[n][0],
                p50_b32_ms=latency[n][1],
                kernel=kernels[n],
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        torch.set_num_threads(max(1, args.threads))
        checkpoint = load_checkpoint(args.model)
        name = checkpoint.model.config.name
        out = args.out if args.out is not None else Path("runs") / f"prune-curve-{name}"
        rows = curve(args, checkpoint)
        settings = {
            "model": name,
            "task": checkpoint.model.config.task,
            "d_model": checkpoint.model.config.d_model,
            "layer_heads": heads_per_layer(checkpoint.model),
            "training": checkpoint.training,
            **{k: getattr(args, k) for k in ("seeds", "finetune_steps", "finetune_lr", "repeats", "threads")},
            "test_examples": TEST_EXAMPLES,
            "timed_by": f"onnxruntime in-process, {args.threads} thread(s)",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        }
        with staged_folder(out) as folder:
            write_report(folder, rows, settings)
    except (CheckpointError, PruneError, ValueError, ExportError, ParityError, TimingError, OSError) as exc:
        print(f"mha-serving prune-curve: {exc}", file=sys.stderr)
        return 2
    print((out / "curve.md").read_text())
    print(f"wrote {out}/curve.md, curve.csv, curve.json, curve.png")
    return 0
