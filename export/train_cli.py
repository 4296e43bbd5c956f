"""`mha-serving train`: train one head configuration on a built-in task, then export it (with its attention variant)
through the normal export path, so the served model is a trained one that carries its task's label names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from export import lm_train_cli
from export.convert import ExportError
from export.docs_corpus import CORPUS
from export.parity import ParityError
from export.tasks import TASKS, get_task
from export.train import TrainConfig, export_trained, train

_DEFAULTS = TrainConfig()


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `train` and `sweep` share (everything a sweep keeps fixed)."""
    parser.add_argument(
        "--task", default=_DEFAULTS.task, help=f"built-in task: {', '.join(TASKS)} (default %(default)s)"
    )
    parser.add_argument("--d-model", type=int, default=_DEFAULTS.d_model, help="model width (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=None, help="per-head size (default d_model / heads)")
    parser.add_argument("--layers", type=int, default=_DEFAULTS.layers, help="encoder blocks (default %(default)s)")
    parser.add_argument("--ff-dim", type=int, default=None, help="MLP width (default 4 * d_model)")
    parser.add_argument("--steps", type=int, default=_DEFAULTS.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size, help="(default %(default)s)")
    parser.add_argument("--lr", type=float, default=_DEFAULTS.lr, help="peak learning rate (default %(default)s)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=_DEFAULTS.warmup_fraction,
        help="warm-up fraction of steps (default %(default)s)",
    )
    parser.add_argument(
        "--grad-clip", type=float, default=_DEFAULTS.grad_clip, help="max gradient norm (default %(default)s)"
    )
    parser.add_argument("--examples", type=int, default=_DEFAULTS.examples, help="generated examples, 10%% held out")
    parser.add_argument("--log-every", type=int, default=_DEFAULTS.log_every, help="steps between progress lines")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads: torch for training, ORT for timing (default %(default)s)",
    )


def training_config(args: argparse.Namespace, heads: int, seed: int) -> TrainConfig:
    """A TrainConfig from parsed options; ValueError (one line) when a value is wrong."""
    return TrainConfig(
        task=args.task,
        heads=heads,
        d_model=args.d_model,
        head_dim=args.head_dim,
        layers=args.layers,
        ff_dim=args.ff_dim,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_fraction=args.warmup,
        grad_clip=args.grad_clip,
        seed=seed,
        examples=args.examples,
        log_every=args.log_every,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mha-serving train",
        description=__doc__,
        epilog=f"--task {CORPUS} trains a decoder-only language model on the Python documentation instead "
        "(--heads, --kv-heads, --d-model, --layers, --max-len, --steps, --batch-size, --lr); docs/heads-lab.md",
    )
    add_training_arguments(parser)
    parser.add_argument("--heads", type=int, default=4, help="number of attention heads (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("models"), help="models folder (default %(default)s)")
    parser.add_argument("--no-attention", action="store_true", help="skip model.attn.onnx (no attention maps)")
    parser.add_argument("--kv-heads", type=int, default=None, help="docs-lm: key/value heads, dividing --heads")
    parser.add_argument("--max-len", type=int, default=None, help="docs-lm: context length in tokens (default 128)")
    parser.add_argument(
        "--val-fraction", type=float, default=None, help="docs-lm: share of the tokens held out (default 0.1)"
    )
    args = parser.parse_args(argv)
    if args.task == CORPUS:
        return lm_train_cli.main(args)
    given = [flag for flag, value in (("--kv-heads", args.kv_heads), ("--max-len", args.max_len)) if value is not None]
    if args.val_fraction is not None:
        given.append("--val-fraction")
    if given:
        print(f"mha-serving train: {given[0]} applies to --task {CORPUS} only", file=sys.stderr)
        return 2

    try:
        config = training_config(args, args.heads, args.seed)
        task = get_task(config.task)
        name = config.model_config(task).name  # ValueError here, before training, when heads do not fit d_model
        torch.set_num_threads(max(1, args.threads))
        print(f"training {name} on {task.name} ({task.description})", flush=True)
        result = train(config, log=lambda line: print(line, flush=True))
        exported = export_trained(result, args.out, attention=not args.no_attention)
    except (ValueError, ExportError, ParityError, FloatingPointError) as exc:
        print(f"mha-serving train: {exc}", file=sys.stderr)
        return 2
    print(
        f"exported {exported.name} to {exported.folder} ({exported.params:,} parameters, val acc "
        f"{result.val_acc:.4f}, labels {', '.join(task.labels)})"
    )
    return 0
