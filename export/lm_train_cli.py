"""`mha-serving train --task docs-lm`: train a decoder-only language model on the Python documentation, report its
validation loss and perplexity against the uniform baseline, and export it behind the generation parity gate."""

from __future__ import annotations

import argparse
import sys

import torch

from export.convert import ExportError
from export.decoder_parity import MIN_CONTEXT, ContextTooShortError
from export.docs_corpus import CORPUS, DESCRIPTION
from export.lm_train import LMTrainConfig, export_trained_lm, train_lm
from export.parity import ParityError

PROG = "mha-serving train"


def lm_config(args: argparse.Namespace) -> LMTrainConfig:
    """The run's LMTrainConfig from train's parsed options; ValueError (one line) when a value is wrong."""
    values = dict(
        heads=args.heads,
        kv_heads=args.kv_heads,
        d_model=args.d_model,
        head_dim=args.head_dim,
        layers=args.layers,
        ff_dim=args.ff_dim,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_fraction=args.warmup,
        grad_clip=args.grad_clip,
        seed=args.seed,
        log_every=args.log_every,
    )
    if args.max_len is not None:
        values["max_len"] = args.max_len
    if args.val_fraction is not None:
        values["val_fraction"] = args.val_fraction
    config = LMTrainConfig(**values)
    if config.max_len < MIN_CONTEXT:
        raise ContextTooShortError(
            f"--max-len {config.max_len} is below {MIN_CONTEXT}: the export's generation parity gate runs a prompt "
            f"and 32 generated tokens within the context length"
        )
    return config


def main(args: argparse.Namespace) -> int:
    """Run with the options `mha-serving train` parsed (export/train_cli.py hands --task docs-lm over here)."""
    try:
        config = lm_config(args)
        name = config.model_config().name
        torch.set_num_threads(max(1, args.threads))
        print(f"training {name} on {CORPUS} ({DESCRIPTION})", flush=True)
        result = train_lm(config, log=lambda line: print(line, flush=True))
        exported = export_trained_lm(result, args.out)
    except (ValueError, ExportError, ParityError, FloatingPointError) as exc:
        print(f"{PROG}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    print(
        f"exported {exported.name} to {exported.folder} ({exported.params:,} parameters, val loss "
        f"{result.val_loss:.4f}, perplexity {result.val_perplexity:.2f}, uniform {result.uniform_loss:.4f}; "
        f"generation parity max diff {exported.max_diff:.2g})"
    )
    return 0
