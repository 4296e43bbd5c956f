"""`mha-serving heads`: which heads of a trained model matter. Per layer and head: the gradient-based importance
(Michel et al. 2019, normalised per layer) and the validation loss and accuracy with that head alone masked; written
as heads.md, heads.csv, heads.json and a layer x head heatmap (heads.png). A decoder's query heads are scored against
the loss per token on its held-out docs-lm windows (export/lm_importance.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from export.checkpoint import CheckpointError, load_checkpoint
from export.heads_report import write_report
from export.importance import HeadReport, run_splits, score_heads
from export.lm_checkpoint import is_decoder, load_decoder
from export.lm_importance import score_decoder_heads
from export.staging import staged_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-serving heads", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    parser.add_argument(
        "--windows", type=int, default=None, help="a decoder: score on the first N held-out windows (default all)"
    )
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/heads-<model name>)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        torch.set_num_threads(max(1, args.threads))
        if args.windows is not None and args.windows < 1:
            raise ValueError(f"--windows must be >= 1, got {args.windows}")
        report = _decoder_report(args) if is_decoder(args.model) else _classifier_report(args)
        out = args.out if args.out is not None else Path("runs") / f"heads-{report.model}"
        with staged_folder(out) as folder:
            write_report(folder, report)
    except (CheckpointError, ValueError, FloatingPointError, OSError) as exc:
        print(f"mha-serving heads: {exc}", file=sys.stderr)
        return 2
    print((out / "heads.md").read_text())
    print(f"wrote {out}/heads.md, heads.csv, heads.json, heads.png")
    return 0


def _classifier_report(args: argparse.Namespace) -> HeadReport:
    checkpoint = load_checkpoint(args.model)
    name = checkpoint.model.config.name
    _, val = run_splits(checkpoint)
    print(f"scoring the heads of {name} on {len(val.labels)} validation examples", flush=True)
    return score_heads(checkpoint.model, name, val)


def _decoder_report(args: argparse.Namespace) -> HeadReport:
    checkpoint = load_decoder(args.model)
    c = checkpoint.model.config
    print(f"scoring the {c.heads} query heads per layer of {c.name} (kv_heads {c.resolved_kv_heads})", flush=True)
    return score_decoder_heads(checkpoint, c.name, args.windows)
