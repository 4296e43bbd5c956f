"""`mha-serving prune`: remove the least important heads of a trained model (re-scored after each removal), optionally
fine-tune a few steps, and export each pruned model through the normal export path and parity gate, next to its
checkpoint and a pruning record (pruning.json), so it serves like any other head configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from export.checkpoint import CHECKPOINT_FILE, Checkpoint, CheckpointError, checkpoint_bytes, load_checkpoint
from export.convert import ExportError, ExportResult, export_model, exporter_versions
from export.importance import heads_per_layer, run_splits
from export.model import AttentionOutputs
from export.parity import ParityError
from export.prune import ORDERS, Pruned, PruneError, PruneSettings, finetune, heads_to_remove, iterative_prune
from export.train import Split, evaluate

PRUNING_FILE = "pruning.json"


def parse_drop(text: str) -> list[float]:
    try:
        drop = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PruneError(f"--drop must be comma-separated fractions such as 0.25,0.5,0.75, got {text!r}") from None
    if not drop:
        raise PruneError(f"--drop needs at least one fraction, got {text!r}")
    return drop


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mha-serving prune", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    parser.add_argument("--drop", default="0.25,0.5,0.75", help="fractions of heads to remove (default %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("models"), help="models folder (default %(default)s)")
    parser.add_argument("--order", choices=ORDERS, default="importance", help="which heads go first (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random order's seed, and fine-tuning's (%(default)s)")
    parser.add_argument("--step", type=int, default=1, help="heads removed between re-scorings (default %(default)s)")
    parser.add_argument("--finetune-steps", type=int, default=0, help="AdamW steps after pruning (default none)")
    parser.add_argument("--finetune-lr", type=float, default=3e-4, help="constant fine-tuning lr (%(default)s)")
    parser.add_argument("--no-attention", action="store_true", help="skip model.attn.onnx (no attention maps)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s)")
    args = parser.parse_args(argv)
    if args.step < 1 or args.finetune_steps < 0 or args.finetune_lr <= 0:
        raise PruneError("need --step >= 1, --finetune-steps >= 0 and --finetune-lr > 0")
    args.drop = parse_drop(args.drop)
    return args


def export_pruned(pruned: Pruned, checkpoint: Checkpoint, out: Path, record: dict, attention: bool) -> ExportResult:
    """Export one pruned model (parity gate included) with its checkpoint and pruning record, all at once."""
    model = pruned.model
    uniform = len(set(heads_per_layer(model))) == 1  # stacked attention weights need one head count
    variant = AttentionOutputs(model) if attention and uniform else None
    extras = {
        CHECKPOINT_FILE: checkpoint_bytes(model, checkpoint.training),
        PRUNING_FILE: (json.dumps(record, indent=2) + "\n").encode(),
    }
    meta = model.config.metadata(exporter_versions())
    return export_model(model, meta, out, attention_variant=variant, extras=extras)


def pruning_record(how: PruneSettings, checkpoint: Checkpoint, pruned: Pruned, fraction: float, before, after) -> dict:
    """pruning.json: which heads went and how, and the validation (loss, accuracy) before and after fine-tuning."""
    return {
        "pruned_from": checkpoint.model.config.name,
        "drop": fraction,
        "removed": pruned.removed,
        "order": how.order,
        "seed": how.seed,
        "step": how.step,
        "layer_heads": heads_per_layer(pruned.model),
        "kept": [list(k) for k in pruned.kept],
        "removed_in_order": [list(pair) for pair in pruned.order],
        "val_loss": before[0],
        "val_acc": before[1],
        "finetune_steps": how.finetune_steps,
        "finetune_lr": how.finetune_lr,
        "val_loss_finetuned": after[0],
        "val_acc_finetuned": after[1],
    }


def finish_pruned(
    how: PruneSettings, checkpoint: Checkpoint, pruned: Pruned, fraction: float, splits: tuple[Split, Split], out: Path
) -> tuple[ExportResult, dict]:
    """Fine-tune `pruned` (in place, as `how` says) and export it with its record; (export, record)."""
    train, val = splits
    before = evaluate(pruned.model, val)
    after = evaluate(finetune(pruned.model, train, how.finetune_steps, how.finetune_lr, seed=how.seed), val)
    record = pruning_record(how, checkpoint, pruned, fraction, before, after)
    return export_pruned(pruned, checkpoint, out, record, attention=how.attention), record


def _prune_all(how: PruneSettings, drop: list[float], checkpoint: Checkpoint, splits: tuple[Split, Split], out: Path):
    counts = heads_to_remove(drop, heads_per_layer(checkpoint.model))  # every fraction checked first
    found = iterative_prune(checkpoint.model, splits[1], list(counts.values()), how.order, how.seed, how.step)
    for fraction, n in counts.items():
        exported, record = finish_pruned(how, checkpoint, found[n], fraction, splits, out)
        tuned = f", {record['val_acc_finetuned']:.4f} after {how.finetune_steps} fine-tuning steps"
        print(
            f"exported {exported.name} to {exported.folder}: {n} head(s) removed, heads per layer "
            f"{','.join(map(str, record['layer_heads']))}, val acc {record['val_acc']:.4f}"
            f"{tuned if how.finetune_steps else ''} (parity max diff {exported.max_diff:.2g})",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        torch.set_num_threads(max(1, args.threads))
        checkpoint = load_checkpoint(args.model)
        heads_to_remove(args.drop, heads_per_layer(checkpoint.model))  # before generating any data
        splits = run_splits(checkpoint)
        base = evaluate(checkpoint.model, splits[1])[1]
        print(f"pruning {checkpoint.model.config.name} (val acc {base:.4f}) in {args.order} order", flush=True)
        attention = not args.no_attention
        how = PruneSettings(args.order, args.seed, args.step, args.finetune_steps, args.finetune_lr, attention)
        _prune_all(how, args.drop, checkpoint, splits, args.out)
    except (CheckpointError, PruneError, ValueError, ExportError, ParityError, FloatingPointError, OSError) as exc:
        print(f"mha-serving prune: {exc}", file=sys.stderr)
        return 2
    return 0
