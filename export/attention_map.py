"""`mha-serving attention`: per layer and per head, a model's attention weights on a text, as a PNG grid of heatmaps.

A classifier's weights come from its folder's ONNX attention variant (model.attn.onnx) through ONNX Runtime, torch-free;
a decoder's (a trained folder, or its checkpoint.pt) from its torch checkpoint (export/decoder_attention.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from contract.attention_map import AttentionMap, AttentionMapError, AttentionModel, check_head
from contract.metadata import ATTENTION_MASK, CONFIG_FILE, INPUT_IDS
from contract.tokenizer import ByteTokenizer

GRID_COLUMNS = 4  # heads per row of the grid; more heads wrap onto further rows


def plot_grid(
    amap: AttentionMap,
    path: Path,
    heads: list[int] | None = None,
    title: str = "",
    head_label: Callable[[int], str] = str,
) -> None:
    """One heatmap per (layer, head): rows are query tokens, columns the key tokens they attend to; `head_label`
    names a head in its title (a decoder's adds the key/value head it shares)."""
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
            ax.set_title(f"layer {layer}, head {head_label(head)}", fontsize=7)
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
    parser.add_argument(
        "--model", type=Path, required=True, help="a model folder (models/mha-h4-d64), or a decoder's checkpoint.pt"
    )
    parser.add_argument("--text", required=True, help="the text to look at (at most max_len tokens, BOS included)")
    parser.add_argument("--out", type=Path, default=Path("attn.png"), help="PNG to write (default %(default)s)")
    parser.add_argument("--layer", type=int, default=None, help="one layer, 0-based (default: every layer)")
    parser.add_argument("--head", type=int, default=None, help="one head, 0-based (default: every head)")
    args = parser.parse_args(argv)
    if _is_decoder(args.model):
        return _decoder_main(args)
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


def _is_decoder(path: Path) -> bool:
    """A decoder's checkpoint file, or a model folder whose config.json says arch=decoder (read without torch)."""
    if path.is_file():
        return path.suffix == ".pt"
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("arch") == "decoder"
    except (OSError, ValueError):
        return False


def _decoder_main(args: argparse.Namespace) -> int:
    """The decoder's causal maps: each query head's own, titled with the key/value head its group shares."""
    from export.decoder_attention import decoder_attention_map, kv_head_of

    try:
        amap, model = decoder_attention_map(args.model, args.text, args.layer)
        check_head(amap.meta, args.head)
        c = model.config
        grouped = c.resolved_kv_heads != c.heads
        label = (lambda head: f"{head} (kv {kv_head_of(model, head)})") if grouped else str
        heads = f"h={c.heads}, kv_heads={c.resolved_kv_heads}"
        title = f"{c.name} ({c.task or 'untrained'}) on {args.text!r}: causal, {heads}"
        plot_grid(amap, args.out, None if args.head is None else [args.head], title, label)
    except (AttentionMapError, OSError) as exc:
        print(f"mha-serving attention: {exc}", file=sys.stderr)
        return 2
    shares = f"; query heads {c.heads // c.resolved_kv_heads} to a key/value head" if grouped else ""
    print(
        f"wrote {args.out}: {len(amap.layers)} layer(s) x {c.heads} query head(s) on {len(amap.tokens)} tokens{shares}"
    )
    return 0
