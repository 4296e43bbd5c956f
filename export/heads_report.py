"""The per-head report of `mha-serving heads`: a table (Markdown, CSV), JSON, and a layer x head heatmap of the
normalised importance, each cell annotated with the accuracy lost when that head alone is masked. Torch-free.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the report itself never runs torch
    from export.importance import HeadReport

REPORT_FILES = ("heads.md", "heads.csv", "heads.json", "heads.png")


def markdown_table(report: HeadReport) -> str:
    if report.arch == "decoder":
        return _decoder_table(report)
    lines = [
        "| layer | head | importance | raw importance | val loss, head masked | val acc, head masked | acc lost |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report.scores:
        lines.append(
            f"| {s.layer} | {s.head} | {s.importance:.3f} | {s.raw_importance:.3g} | {s.masked_loss:.4f} | "
            f"{s.masked_acc:.4f} | {report.base_acc - s.masked_acc:+.4f} |"
        )
    return "\n".join(lines) + "\n"


def _decoder_table(report: HeadReport) -> str:
    """A decoder's query heads, each with the key/value head it shares, against the loss per token."""
    lines = [
        "| layer | query head | kv head | importance | raw importance | val loss, head masked | loss added "
        "| next-token acc, head masked |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report.scores:
        lines.append(
            f"| {s.layer} | {s.head} | {s.kv_head} | {s.importance:.3f} | {s.raw_importance:.3g} | "
            f"{s.masked_loss:.4f} | {s.masked_loss - report.base_loss:+.4f} | {s.masked_acc:.4f} |"
        )
    return "\n".join(lines) + "\n"


def heatmap(report: HeadReport, path: Path) -> None:
    """Layers as rows, heads as columns, colour = normalised importance; text = accuracy lost when masked (a
    decoder's: loss per token added)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = 1 + max(s.layer for s in report.scores)
    width = 1 + max(s.head for s in report.scores)
    grid = np.full((layers, width), np.nan)  # (layers, max heads): a pruned layer's missing heads stay blank
    for s in report.scores:
        grid[s.layer, s.head] = s.importance
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * width, 1.2 + 0.7 * layers))
    image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    decoder = report.arch == "decoder"
    for s in report.scores:
        colour = "black" if s.importance > 0.6 else "white"
        lost = s.masked_loss - report.base_loss if decoder else report.base_acc - s.masked_acc
        text = f"{s.importance:.2f}\n{lost:+.3f}"
        ax.text(s.head, s.layer, text, ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(width))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(
        f"{report.model}: head importance (normalised per layer)\nbelow: "
        + ("validation loss added" if decoder else "accuracy lost")
        + " with the head alone masked",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(folder: Path, report: HeadReport) -> list[Path]:
    """heads.md, heads.csv, heads.json and heads.png in `folder`; returns their paths."""
    paths = [folder / name for name in REPORT_FILES]
    accuracy = "next-token accuracy" if report.arch == "decoder" else "accuracy"
    title = (
        f"# {report.model}: which heads matter\n\nValidation split of its training run ({report.examples} "
        f"{report.unit}): loss {report.base_loss:.4f}, {accuracy} {report.base_acc:.4f} with every head.\n\n"
    )
    paths[0].write_text(title + markdown_table(report))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(report.scores[0])))
        writer.writeheader()
        writer.writerows(asdict(s) for s in report.scores)
    paths[2].write_text(json.dumps(asdict(report), indent=2, allow_nan=False) + "\n")
    heatmap(report, paths[3])
    return paths
