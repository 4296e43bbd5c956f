"""The pruning curve's report: one row per number of heads removed (importance order, random order mean and spread,
p50 latency at batch 1 and 32), the latency saved per head removed (least-squares slope), the table (Markdown, CSV),
JSON and a two-panel plot. Torch-free.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

ACC_TOLERANCE = 0.01  # "as good as the full model": test accuracy within this of it


@dataclass(frozen=True)
class CurveRow:
    removed: int
    fraction: float  # of all heads
    heads_kept: int
    acc_importance: float  # test accuracy, heads removed in importance order (re-scored after each)
    acc_random_mean: float  # over the random orders' seeds
    acc_random_std: float
    p50_b1_ms: float  # the importance-order model exported and timed in ONNX Runtime
    p50_b32_ms: float
    kernel: str  # the exported graph's attention kernel (a single-head layer is exported unfused)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (0 with fewer than two distinct xs)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def saved_per_head(rows: list[CurveRow]) -> tuple[float, float]:
    """Milliseconds saved per head removed at batch 1 and 32: minus the slope of p50 against heads removed, over the
    models that run the full model's attention kernel (a layer left with one head runs another one)."""
    same = [r for r in rows if r.kernel == rows[0].kernel]
    xs = [float(r.removed) for r in same]
    return -slope(xs, [r.p50_b1_ms for r in same]), -slope(xs, [r.p50_b32_ms for r in same])


def fewest_heads_within(rows: list[CurveRow], key: str) -> int:
    """The fewest heads kept with accuracy (`key`) within ACC_TOLERANCE of the full model, along the curve."""
    full = getattr(rows[0], key)
    kept = rows[0].heads_kept
    for r in rows:
        if getattr(r, key) < full - ACC_TOLERANCE:
            break
        kept = r.heads_kept
    return kept


def summary(rows: list[CurveRow]) -> list[str]:
    b1, b32 = saved_per_head(rows)
    full = rows[0]
    return [
        f"Full model: {full.heads_kept} heads, test accuracy {full.acc_importance:.4f}, p50 {full.p50_b1_ms:.3f} ms at "
        f"batch 1 and {full.p50_b32_ms:.3f} ms at batch 32.",
        f"Accuracy stays within {ACC_TOLERANCE} of the full model down to {fewest_heads_within(rows, 'acc_importance')}"
        f" head(s) in importance order and {fewest_heads_within(rows, 'acc_random_mean')} in random order (mean).",
        f"Latency saved per head removed (least-squares slope over the models with the full model's attention kernel, "
        f"{full.kernel}): {b1 * 1e3:.1f} us at batch 1, "
        f"{b32 * 1e3:.1f} us at batch 32 ({100 * b1 / full.p50_b1_ms:.1f} % and {100 * b32 / full.p50_b32_ms:.1f} % "
        f"of the full model's p50).",
    ]


def markdown_table(rows: list[CurveRow]) -> str:
    lines = [
        "| heads pruned | fraction | heads kept | acc, importance order | acc, random order | "
        "p50 batch 1 (ms) | p50 batch 32 (ms) | attention kernel |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.removed} | {r.fraction:.3f} | {r.heads_kept} | {r.acc_importance:.4f} | "
            f"{r.acc_random_mean:.4f} ± {r.acc_random_std:.4f} | {r.p50_b1_ms:.3f} | {r.p50_b32_ms:.3f} | {r.kernel} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[CurveRow], path: Path, title: str) -> None:
    """Left: test accuracy against the fraction pruned (importance order; random order mean ± sd). Right: p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.fraction for r in rows]
    total = rows[0].heads_kept
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [r.acc_importance for r in rows], "o-", label="importance order (re-scored)")
    mean = [r.acc_random_mean for r in rows]
    std = [r.acc_random_std for r in rows]
    left.errorbar(xs, mean, yerr=std, fmt="s--", capsize=3, label="random order (mean ± sd)")
    left.set_xlabel("fraction of heads pruned")
    left.set_ylabel("test accuracy")
    left.legend(fontsize=8)
    right.plot(xs, [r.p50_b1_ms for r in rows], "o-", label="batch 1")
    right.set_ylabel("p50 latency, batch 1 (ms)")
    twin = right.twinx()
    twin.plot(xs, [r.p50_b32_ms for r in rows], "s--", color="tab:red", label="batch 32")
    twin.set_ylabel("p50 latency, batch 32 (ms)", color="tab:red")
    right.set_xlabel("fraction of heads pruned")
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="lower left")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        top = ax.secondary_xaxis("top", functions=(lambda f: total * (1 - f), lambda k: 1 - k / total))
        top.set_xlabel("heads kept", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(folder: Path, rows: list[CurveRow], settings: dict[str, object]) -> list[Path]:
    """curve.md, curve.csv, curve.json and curve.png in `folder`; returns their paths."""
    title = f"{settings['model']} on {settings['task']}: heads pruned against accuracy and latency"
    paths = [folder / name for name in ("curve.md", "curve.csv", "curve.json", "curve.png")]
    notes = "\n".join(f"- {line}" for line in summary(rows))
    paths[0].write_text(f"# {title}\n\n{markdown_table(rows)}\n{notes}\n")
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    b1, b32 = saved_per_head(rows)
    record = {
        "settings": settings,
        "rows": [asdict(r) for r in rows],
        "saved_per_head_ms": {"batch_1": b1, "batch_32": b32},
        "summary": summary(rows),
    }
    paths[2].write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    plot(rows, paths[3], title)
    return paths
