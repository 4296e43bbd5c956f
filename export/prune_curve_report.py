"""The pruning curve's report: one row per number of heads removed (importance order, random order mean and spread,
p50 latency at batch 1 and 32, and the importance-order model's int8 twin beside it), the latency saved per head removed
(least-squares slope), the table (Markdown, CSV), JSON and a two-panel plot. Torch-free.
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
    # int8: the exported importance-order model quantized (dynamic), on the same test examples (None: not measured)
    int8_acc: float | None = None
    int8_fp32_acc: float | None = None  # the fp32 model in ONNX Runtime on the same examples: what int8 is set against
    int8_agreement: float | None = None  # fraction of examples whose argmax equals the fp32 model's
    int8_p50_b1_ms: float | None = None  # timed in the same interleaved rounds as the fp32 models
    int8_p50_b32_ms: float | None = None

    @property
    def has_int8(self) -> bool:
        return self.int8_agreement is not None


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (0 with fewer than two distinct xs)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def saved_per_head(rows: list[CurveRow], precision: str = "fp32") -> tuple[float, float]:
    """Milliseconds saved per head removed at batch 1 and 32: minus the slope of p50 against heads removed, over the
    models that run the full model's attention kernel (a layer left with one head runs another one); of the int8
    twins with precision "int8"."""
    same = [r for r in rows if r.kernel == rows[0].kernel]
    xs = [float(r.removed) for r in same]
    b1, b32 = ("p50_b1_ms", "p50_b32_ms") if precision == "fp32" else ("int8_p50_b1_ms", "int8_p50_b32_ms")
    return -slope(xs, [getattr(r, b1) for r in same]), -slope(xs, [getattr(r, b32) for r in same])


def fewest_heads_within(rows: list[CurveRow], key: str, reference: str = "") -> int:
    """The fewest heads kept with accuracy (`key`) within ACC_TOLERANCE of the full model's (`reference`, by default
    the same key), along the curve."""
    full = getattr(rows[0], reference or key)
    kept = rows[0].heads_kept
    for r in rows:
        if getattr(r, key) < full - ACC_TOLERANCE:
            break
        kept = r.heads_kept
    return kept


def int8_summary(rows: list[CurveRow]) -> list[str]:
    """What int8 costs and buys along the curve; nothing when the twins were not measured."""
    if not all(r.has_int8 for r in rows):
        return []
    full = rows[0]
    worst, at = min((r.int8_acc - r.int8_fp32_acc, r.removed) for r in rows)
    kept = fewest_heads_within(rows, "int8_acc", "acc_importance")
    b1 = [r.int8_p50_b1_ms / r.p50_b1_ms for r in rows]
    b32 = [r.int8_p50_b32_ms / r.p50_b32_ms for r in rows]
    return [
        f"int8 (dynamic): the full model's twin has test accuracy {full.int8_acc:.4f} (fp32 in ONNX Runtime "
        f"{full.int8_fp32_acc:.4f}, argmax agreement {full.int8_agreement:.2%}) and p50 {full.int8_p50_b1_ms:.3f} ms "
        f"at batch 1 and {full.int8_p50_b32_ms:.3f} ms at batch 32 ({b1[0]:.2f}x and {b32[0]:.2f}x fp32, same rounds).",
        f"Along the curve, int8 p50 is {min(b1):.2f}-{max(b1):.2f}x fp32 at batch 1 and {min(b32):.2f}-{max(b32):.2f}x "
        f"at batch 32; int8 - fp32 accuracy is {worst:+.4f} at worst ({at} head(s) pruned), and int8 stays within "
        f"{ACC_TOLERANCE} of the full fp32 model down to {kept} head(s).",
    ]


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
        *int8_summary(rows),
    ]


def markdown_table(rows: list[CurveRow]) -> str:
    """One line per model; with int8 twins measured, each int8 column beside its fp32 one."""
    int8 = all(r.has_int8 for r in rows)
    columns = ["heads pruned", "fraction", "heads kept", "acc, importance order", "acc, int8 (importance)"]
    columns += ["acc, random order", "p50 batch 1 (ms)", "int8 p50 batch 1 (ms)", "p50 batch 32 (ms)"]
    columns += ["int8 p50 batch 32 (ms)", "attention kernel"]
    keep = [int8 or "int8" not in c for c in columns]
    lines = [_table_line([c for c, k in zip(columns, keep, strict=True) if k])]
    lines.append("| " + "---: | " * (sum(keep) - 1) + "--- |")
    for r in rows:
        cells = [str(r.removed), f"{r.fraction:.3f}", str(r.heads_kept), f"{r.acc_importance:.4f}"]
        cells += [f"{r.int8_acc:.4f}" if int8 else ""]
        cells += [f"{r.acc_random_mean:.4f} ± {r.acc_random_std:.4f}", f"{r.p50_b1_ms:.3f}"]
        cells += [f"{r.int8_p50_b1_ms:.3f}" if int8 else "", f"{r.p50_b32_ms:.3f}"]
        cells += [f"{r.int8_p50_b32_ms:.3f}" if int8 else "", r.kernel]
        lines.append(_table_line([c for c, k in zip(cells, keep, strict=True) if k]))
    return "\n".join(lines) + "\n"


def _table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def plot(rows: list[CurveRow], path: Path, title: str) -> None:
    """Left: test accuracy against the fraction pruned (importance order; random order mean ± sd). Right: p50.
    With int8 twins measured, their accuracy and p50 as dotted curves beside the importance-order fp32 ones."""
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
    int8 = all(r.has_int8 for r in rows)
    if int8:
        left.plot(xs, [r.int8_acc for r in rows], "x:", color="tab:green", label="importance order, int8")
    left.set_xlabel("fraction of heads pruned")
    left.set_ylabel("test accuracy")
    left.legend(fontsize=8)
    right.plot(xs, [r.p50_b1_ms for r in rows], "o-", color="tab:blue", label="batch 1")
    right.set_ylabel("p50 latency, batch 1 (ms)")
    twin = right.twinx()
    twin.plot(xs, [r.p50_b32_ms for r in rows], "s--", color="tab:red", label="batch 32")
    if int8:
        right.plot(xs, [r.int8_p50_b1_ms for r in rows], "o:", color="tab:blue", mfc="none", label="batch 1, int8")
        twin.plot(xs, [r.int8_p50_b32_ms for r in rows], "s:", color="tab:red", mfc="none", label="batch 32, int8")
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
    method = settings.get("int8")
    if isinstance(method, dict):
        bits = "7 bits (reduce_range)" if method["reduce_range"] else "full range"
        weights = f"{method['weights']} weights, {bits}"
        notes += (
            f"\n- int8 columns: ONNX Runtime's {method['mode']} quantization of each importance-order model "
            f"({weights}: {method['why']}), measured in ONNX Runtime on {method['data']} and timed in the same rounds "
            "as fp32."
        )
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
    if all(r.has_int8 for r in rows):
        q_b1, q_b32 = saved_per_head(rows, "int8")
        record["int8_saved_per_head_ms"] = {"batch_1": q_b1, "batch_32": q_b32}
    paths[2].write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    plot(rows, paths[3], title)
    return paths
