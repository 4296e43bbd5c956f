"""`mha-serving attention`: per layer and per head, a model's attention weights on a text, as a PNG grid of heatmaps.

Torch-free: the weights come from the model folder's ONNX attention variant (model.attn.onnx) through ONNX Runtime.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from contract.attention_map import AttentionMap, AttentionMapError, AttentionModel, check_head
from contract.metadata import ATTENTION_MASK, INPUT_IDS
from contract.tokenizer import ByteTokenizer

GRID_COLUMNS = 4  # heads per row of the grid; more heads wrap onto further rows


def plot_grid(amap: AttentionMap, path: Path, heads: list[int] | None = None, title: str = "") -> None:
    """One heatmap per (layer, head): rows are query tokens, columns the key tokens they attend to."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(range(amap.meta.heads)) if heads is None else heads
    cols = min(len(heads), GRID_COLUMNS)
    rows_per_layer = math.ceil(len(heads) / cols)
    n_rows = rows_per_layer * len(amap.layers)
    size = 1.0 + 0.2 * len(amap.tokens)  # inches per heatmap
    vmax = float(amap.weights.max())  # one colour scale for the whole grid, so heads compare
    fig, axes = plt.subplots(n_rows, cols, figsize=(cols * size, n_rows * size + 0.6), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    ticks = range(len(amap.tokens))
    for li, layer in enumerate(amap.layers):
        for i, head in enumerate(heads):
            ax = axes[li * rows_per_layer + i // cols, i % cols]
            ax.axis("on")
            ax.imshow(amap.weights[li, head], vmin=0.0, vmax=vmax, cmap="viridis")
            ax.set_title(f"layer {layer}, head {head}", fontsize=7)
            ax.set_xticks(ticks, amap.tokens, fontsize=7, rotation=90)
            ax.set_yticks(ticks, amap.tokens if i % cols == 0 else [], fontsize=7)
            ax.tick_params(length=0)
    fig.suptitle(
        (title or amap.meta.name) + f"\nrow: query token, column: key token it attends to; colour 0..{vmax:.2f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-serving attention", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a model folder, e.g. models/mha-h4-d64")
    parser.add_argument("--text", required=True, help="the text to look at (at most max_len tokens, BOS included)")
    parser.add_argument("--out", type=Path, default=Path("attn.png"), help="PNG to write (default %(default)s)")
    parser.add_argument("--layer", type=int, default=None, help="one layer, 0-based (default: every layer)")
    parser.add_argument("--head", type=int, default=None, help="one head, 0-based (default: every head)")
    args = parser.parse_args(argv)
    try:
        model = AttentionModel(args.model)
        check_head(model.meta, args.head)
        amap = model.attention_map(args.text, args.layer)
        predicted = _predicted_label(model, args.text)
        title = f"{model.meta.name} ({model.meta.task or 'untrained'}) on {args.text!r}: predicted {predicted}"
        plot_grid(amap, args.out, None if args.head is None else [args.head], title)
    except (AttentionMapError, OSError) as exc:
        print(f"mha-serving attention: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(amap.layers)} layer(s) x {model.meta.heads} head(s) on {len(amap.tokens)} tokens")
    return 0


def _predicted_label(model: AttentionModel, text: str) -> str:
    ids = ByteTokenizer(model.meta.max_len).encode(text)
    feed = {INPUT_IDS: np.array([ids], dtype=np.int64), ATTENTION_MASK: np.ones((1, len(ids)), dtype=np.int64)}
    (logits,) = model.session.run(["logits"], feed)  # (1, C)
    return model.meta.labels[int(logits[0].argmax())]
