"""`mha-serving prune-curve`: accuracy and latency against the fraction of heads pruned, for one trained model.

Heads are removed one at a time in importance order (re-scored after each removal, on the run's validation split)
and in random order (several seeds); accuracy is measured on fresh examples of the task that neither training nor
scoring saw; each importance-order model is exported through the normal path (parity gate) and timed with ONNX
Runtime in-process at batch 1 and 32, all models in interleaved rounds. Each exported model also gets an int8 twin
(dynamic quantization), measured on the same test examples and timed in the same rounds, unless --no-int8.
Writes curve.md, .csv, .json and .png.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, pstdev

import numpy as np
import torch

from export.checkpoint import CheckpointError, load_checkpoint
from export.convert import ExportError, export_model, exporter_versions
from export.importance import heads_per_layer, run_splits
from export.parity import ParityError
from export.prune import PruneError, finetune, iterative_prune
from export.prune_curve_report import CurveRow, write_report
from export.quantize import GateData, QuantizeError, cpu_flags, plan_int8
from export.staging import staged_folder
from export.sweep import LATENCY_SEED
from export.sweep_timing import INT8_MODE, Int8Twin, TimingError, in_process_caller, int8_twin, time_models
from export.tasks import get_task
from export.train import Split, TrainConfig, encode_examples, evaluate

TEST_SEED_OFFSET = 1_000_003  # the test examples' seed: the run's seed plus this (never a training or scoring seed)
TEST_EXAMPLES = 2000
# what the command reports in one line with exit status 2 (anything else is a bug, with its traceback)
ONE_LINE_ERRORS = (
    CheckpointError,
    PruneError,
    ValueError,
    ExportError,
    ParityError,
    TimingError,
    QuantizeError,
    OSError,
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mha-serving prune-curve", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    parser.add_argument("--seeds", type=int, default=3, help="random orders to compare with (default %(default)s)")
    parser.add_argument("--finetune-steps", type=int, default=0, help="AdamW steps after each pruning (default none)")
    parser.add_argument("--finetune-lr", type=float, default=3e-4, help="constant fine-tuning lr (%(default)s)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls at batch 1 (batch 32: a quarter)")
    parser.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads (%(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/prune-curve-<model>)")
    parser.add_argument("--no-int8", action="store_true", help="no int8 twins of the importance-order models")
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


def _test_data(test: Split, seed: int) -> GateData:
    """The test examples as ONNX Runtime's int8 measurement takes them."""
    ids, mask, labels = (t.numpy().astype(np.int64) for t in (test.ids, test.mask, test.labels))
    return GateData(ids, mask, labels, f"{len(labels)} test examples (seed {seed})")


@dataclass(frozen=True)
class Timed:
    """The importance-order models, exported: p50 ms at batch 1 and 32 (fp32, and int8 twins) and attention kernels,
    each keyed by heads removed."""

    latency: dict[int, tuple[float, ...]]
    kernels: dict[int, str]
    int8: dict[int, Int8Twin]
    int8_latency: dict[int, tuple[float, ...]]
    int8_method: dict[str, object] | str  # how the twins were made and measured, for the settings


def _latency(args, checkpoint, val, counts: list[int], scratch: Path, test: GateData) -> Timed:
    """Export each importance-order model, quantize it to int8 and measure the twin on `test` (unless --no-int8), then
    time every model in ORT in the same interleaved rounds, so each int8/fp32 ratio shares the machine's noise."""
    found = iterative_prune(checkpoint.model, val, counts, "importance")
    task = get_task(checkpoint.model.config.task)
    texts = [e.text for e in task.generate(64, LATENCY_SEED)]
    plan = plan_int8(cpu_flags())
    method = {"mode": INT8_MODE, "weights": plan.weights, "reduce_range": plan.reduce_range, "why": plan.reason}
    callers, kernels, twins = {}, {}, {}
    for n, pruned in found.items():
        exported = export_model(pruned.model, pruned.model.config.metadata(exporter_versions()), scratch)
        callers[n, "fp32"] = in_process_caller(exported.folder, texts, task.max_len, args.threads)
        kernels[n] = exported.metadata.attention_kernel
        print(f"  exported {exported.name} ({n} head(s) removed, {kernels[n]}) for timing", flush=True)
        if not args.no_int8:
            twins[n] = int8_twin(exported.folder, scratch, test, plan)
            callers[n, "int8"] = in_process_caller(twins[n].folder, texts, task.max_len, args.threads)
            print(f"    int8: test acc {twins[n].accuracy:.4f}, argmax agreement {twins[n].agreement:.2%}", flush=True)
    latency = time_models(callers, args.repeats)
    by_precision = {p: {n: ms for (n, q), ms in latency.items() if q == p} for p in ("fp32", "int8")}
    method = "not measured: --no-int8" if args.no_int8 else {**method, "data": test.source}
    return Timed(by_precision["fp32"], kernels, twins, by_precision["int8"], method)


def curve(args: argparse.Namespace, checkpoint) -> tuple[list[CurveRow], dict[str, object] | str]:
    """The curve's rows, and how its int8 twins were made and measured (for the settings)."""
    layer_heads = heads_per_layer(checkpoint.model)
    total, counts = sum(layer_heads), list(range(sum(layer_heads) - len(layer_heads) + 1))  # 0 .. every layer at 1
    config = TrainConfig(**checkpoint.training)  # type: ignore[arg-type]
    train, val = run_splits(checkpoint)
    test = encode_examples(get_task(config.task), TEST_EXAMPLES, config.seed + TEST_SEED_OFFSET)
    test_data = _test_data(test, config.seed + TEST_SEED_OFFSET)
    print(f"importance order: {len(counts) - 1} removals, re-scored after each", flush=True)
    ranked = _accuracies(args, checkpoint, "importance", 0, counts, train, val, test)
    randoms = []
    for seed in range(args.seeds):
        print(f"random order, seed {seed}", flush=True)
        randoms.append(_accuracies(args, checkpoint, "random", seed, counts, train, val, test))
    twins = "" if args.no_int8 else " and their int8 twins"
    print(f"timing {len(counts)} models{twins} in-process ({args.threads} ORT thread(s))", flush=True)
    with tempfile.TemporaryDirectory(prefix=".prune-curve.") as scratch:
        timed = _latency(args, checkpoint, val, counts, Path(scratch), test_data)
    rows = []
    for n in counts:
        accs = [r[n] for r in randoms]
        twin = timed.int8.get(n)
        q_b1, q_b32 = timed.int8_latency.get(n, (None, None))
        rows.append(
            CurveRow(
                removed=n,
                fraction=n / total,
                heads_kept=total - n,
                acc_importance=ranked[n],
                acc_random_mean=mean(accs),
                acc_random_std=pstdev(accs),
                p50_b1_ms=timed.latency[n][0],
                p50_b32_ms=timed.latency[n][1],
                kernel=timed.kernels[n],
                int8_acc=twin and twin.accuracy,
                int8_fp32_acc=twin and twin.fp32_accuracy,
                int8_agreement=twin and twin.agreement,
                int8_p50_b1_ms=q_b1,
                int8_p50_b32_ms=q_b32,
            )
        )
    return rows, timed.int8_method


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        torch.set_num_threads(max(1, args.threads))
        checkpoint = load_checkpoint(args.model)
        name = checkpoint.model.config.name
        out = args.out if args.out is not None else Path("runs") / f"prune-curve-{name}"
        rows, int8 = curve(args, checkpoint)
        settings = {
            "model": name,
            "task": checkpoint.model.config.task,
            "d_model": checkpoint.model.config.d_model,
            "layer_heads": heads_per_layer(checkpoint.model),
            "training": checkpoint.training,
            **{k: getattr(args, k) for k in ("seeds", "finetune_steps", "finetune_lr", "repeats", "threads")},
            "no_int8": args.no_int8,
            "int8": int8,
            "test_examples": TEST_EXAMPLES,
            "timed_by": f"onnxruntime in-process, {args.threads} thread(s)",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        }
        with staged_folder(out) as folder:
            write_report(folder, rows, settings)
    except ONE_LINE_ERRORS as exc:
        print(f"mha-serving prune-curve: {exc}", file=sys.stderr)
        return 2
    print((out / "curve.md").read_text())
    print(f"wrote {out}/curve.md, curve.csv, curve.json, curve.png")
    return 0
