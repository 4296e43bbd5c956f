"""`mha-serving heads`: which heads of a trained model matter. Per layer and head: the gradient-based importance
(Michel et al. 2019, normalised per layer) and the validation loss and accuracy with that head alone masked; written
as heads.md, heads.csv, heads.json and a layer x head heatmap (heads.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from export.checkpoint import CheckpointError, load_checkpoint
from export.heads_report import write_report
from export.importance import run_splits, score_heads
from export.staging import staged_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-serving heads", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/heads-<model name>)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        torch.set_num_threads(max(1, args.threads))
        checkpoint = load_checkpoint(args.model)
        name = checkpoint.model.config.name
        out = args.out if args.out is not None else Path("runs") / f"heads-{name}"
        _, val = run_splits(checkpoint)
        print(f"scoring the heads of {name} on {len(val.labels)} validation examples", flush=True)
        report = score_heads(checkpoint.model, name, val)
        with staged_folder(out) as folder:
            write_report(folder, report)
    except (CheckpointError, ValueError, FloatingPointError, OSError) as exc:
        print(f"mha-serving heads: {exc}", file=sys.stderr)
        return 2
    print((out / "heads.md").read_text())
    print(f"wrote {out}/heads.md, heads.csv, heads.json, heads.png")
    return 0
