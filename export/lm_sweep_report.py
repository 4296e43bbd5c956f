"""The decoders' sweep report: one row per (h, kv_heads) over its seeds (validation loss mean and spread, perplexity,
KV bytes per token), written as the classifiers' sweep writes its own (sweep.md, .csv, .json, .png), with what the
numbers say about h and kv_heads. Torch-free.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean, pstdev


@dataclass(frozen=True)
class LMRun:
    """One trained decoder, one seed."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seed: int
    params: int
    val_loss: float  # nats per held-out token
    val_perplexity: float
    kv_bytes_per_token: int  # float32 cache: 2 x layers x kv_heads x head_dim x 4
    train_s: float
    max_grad_norm: float  # the largest gradient norm of the run (before clipping)


@dataclass(frozen=True)
class LMRow:
    """One (h, kv_heads) configuration over its seeds."""

    heads: int
    kv_heads: int
    head_dim: int
    params: int
    seeds: int
    val_loss_mean: float
    val_loss_std: float  # population sd over seeds, as the classifiers' sweep
    perplexity: float  # exp(val_loss_mean): the perplexity of the mean loss
    kv_bytes_per_token: int
    train_s_mean: float
    max_grad_norm_mean: float


def summarize(runs: list[LMRun]) -> list[LMRow]:
    """Rows in the order the configurations first appear in `runs`."""
    rows = []
    for h, kv in dict.fromkeys((r.heads, r.kv_heads) for r in runs):
        mine = [r for r in runs if (r.heads, r.kv_heads) == (h, kv)]
        loss = mean(r.val_loss for r in mine)
        rows.append(
            LMRow(
                heads=h,
                kv_heads=kv,
                head_dim=mine[0].head_dim,
                params=mine[0].params,
                seeds=len(mine),
                val_loss_mean=loss,
                val_loss_std=pstdev(r.val_loss for r in mine),
                perplexity=math.exp(loss),
                kv_bytes_per_token=mine[0].kv_bytes_per_token,
                train_s_mean=mean(r.train_s for r in mine),
                max_grad_norm_mean=mean(r.max_grad_norm for r in mine),
            )
        )
    return rows


def h_axis(rows: list[LMRow]) -> list[LMRow]:
    """The MHA rows (kv_heads = h), by h: the sweep over h at a fixed d_model."""
    return sorted((r for r in rows if r.kv_heads == r.heads), key=lambda r: r.heads)


def kv_axis(rows: list[LMRow]) -> list[LMRow]:
    """The rows at the largest h, by kv_heads: the sweep over kv_heads (empty when only MHA was swept there)."""
    top = max(r.heads for r in rows)
    found = sorted((r for r in rows if r.heads == top), key=lambda r: r.kv_heads)
    return found if len(found) > 1 else []


def markdown_table(rows: list[LMRow]) -> str:
    head = (
        "| h | kv_heads | head_dim | params | val loss (nats/token) | perplexity | KV bytes / token | train s "
        "| max grad norm |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = [
        f"| {r.heads} | {r.kv_heads} | {r.head_dim} | {r.params:,} | {r.val_loss_mean:.4f} ± {r.val_loss_std:.4f} "
        f"| {r.perplexity:.2f} | {r.kv_bytes_per_token:,} | {r.train_s_mean:.1f} | {r.max_grad_norm_mean:.2f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def findings(rows: list[LMRow]) -> list[str]:
    """What the numbers say, one line each: the best h, and each kv_heads's loss and cache against MHA at the top h."""
    lines = []
    by_h = h_axis(rows)
    if len(by_h) > 1:
        best = min(by_h, key=lambda r: r.val_loss_mean)
        within = [r.heads for r in by_h if r.val_loss_mean - best.val_loss_mean <= max(best.val_loss_std, 1e-12)]
        lines.append(
            f"over h (kv_heads = h): the lowest validation loss is at h={best.heads} ({best.val_loss_mean:.4f} ± "
            f"{best.val_loss_std:.4f}); within its seed spread: h in {{{', '.join(map(str, within))}}}"
        )
    by_kv = kv_axis(rows)
    full = next((r for r in by_kv if r.kv_heads == r.heads), None)
    for r in by_kv:
        if full is None or r is full:
            continue
        noise = max(r.val_loss_std, full.val_loss_std)
        delta = r.val_loss_mean - full.val_loss_mean
        where = "within" if abs(delta) <= noise else "outside"
        lines.append(
            f"h={r.heads}, kv_heads={r.kv_heads}: {r.kv_bytes_per_token / full.kv_bytes_per_token:.2f} x MHA's KV "
            f"bytes per token, validation loss {delta:+.4f} against MHA ({where} the seed spread of {noise:.4f})"
        )
    return lines


def plot(rows: list[LMRow], path: Path, title: str) -> None:
    """Validation loss (mean, error bar = seed spread) against h (MHA) and against kv_heads at the largest h."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(h_axis(rows), "heads", "h (kv_heads = h, d_model fixed)")]
    if kv_axis(rows):
        panels.append((kv_axis(rows), "kv_heads", f"kv_heads (h = {max(r.heads for r in rows)})"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, (axis_rows, key, label) in zip(axes[0], panels, strict=True):
        xs = [getattr(r, key) for r in axis_rows]
        ys = [r.val_loss_mean for r in axis_rows]
        ax.errorbar(xs, ys, yerr=[r.val_loss_std for r in axis_rows], fmt="o-", capsize=3)
        for r, x, y in zip(axis_rows, xs, ys, strict=True):
            note = f"{r.kv_bytes_per_token:,} B/token"
            ax.annotate(note, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss, nats/token (mean ± sd over seeds)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(
    out: Path, rows: list[LMRow], runs: list[LMRun], settings: dict[str, object], title: str
) -> list[Path]:
    """sweep.md, sweep.csv, sweep.json and sweep.png in `out`; returns their paths."""
    found = findings(rows)
    md = f"# {title}\n\n{markdown_table(rows)}\n"
    md += "KV bytes / token: the float32 cache, 2 (key, value) x layers x kv_heads x head_dim x 4 bytes.\n"
    if found:
        md += "\n## What the numbers say\n\n" + "\n".join(f"- {line}." for line in found) + "\n"
    paths = [out / "sweep.md", out / "sweep.csv", out / "sweep.json", out / "sweep.png"]
    paths[0].write_text(md)
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    record = {
        "settings": settings,
        "rows": [asdict(r) for r in rows],
        "runs": [asdict(r) for r in runs],
        "findings": found,
    }
    paths[2].write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    plot(rows, paths[3], title)
    return paths
