"""The report's PNG plots (matplotlib, Agg): latency versus h, throughput versus concurrency, latency-throughput.

Models of the same h at different precisions (an fp32 model and its int8 variant) are separate lines throughout.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.stats import LevelResult, precision_rank


def _measured(results: list[LevelResult]) -> list[LevelResult]:
    return [r for r in results if r.latency_ms]


def series_name(r: LevelResult) -> str:
    return f"h={r.heads} {r.precision} ({r.model})"


def series(results: list[LevelResult]) -> dict[str, list[LevelResult]]:
    """One series per model, named by its h and precision, ordered by h and then precision (fp32 first)."""
    out: dict[str, list[LevelResult]] = {}
    for r in sorted(results, key=lambda r: (*r.group_key, r.model)):
        out.setdefault(series_name(r), []).append(r)
    return out


def precisions(results: list[LevelResult]) -> list[str]:
    """The precisions measured, fp32 first."""
    return sorted({r.precision for r in results}, key=lambda p: (precision_rank(p), p))


def latency_vs_heads(results: list[LevelResult], path: Path) -> bool:
    """One panel per load level: p50/p90/p99 against the number of heads, a line per percentile and precision."""
    measured = _measured(results)
    levels = list(dict.fromkeys(r.level for r in measured))
    kinds = precisions(measured)
    if not levels:
        return False
    cols = min(len(levels), 4)
    rows_n = -(-len(levels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False, sharey=True)
    for ax in axes.flat[len(levels) :]:
        ax.set_visible(False)
    for ax, level in zip(axes.flat, levels, strict=False):
        at_level = [r for r in measured if r.level == level]
        heads = [r.heads for r in at_level]
        for k, precision in enumerate(kinds):
            rows = sorted((r for r in at_level if r.precision == precision), key=lambda r: (r.heads, r.model))
            for i, (key, style) in enumerate((("p50", "o-"), ("p90", "s--"), ("p99", "^:"))):
                x, y = [r.heads for r in rows], [r.latency_ms[key] for r in rows]
                ax.plot(x, y, style, color=f"C{(3 * k + i) % 10}", label=f"{key} {precision}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(heads)), [str(h) for h in sorted(set(heads))])
        ax.set_yscale("log")
        ax.set_title(level)
        ax.set_xlabel("heads h")
        ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("client latency (ms)")
    axes[0][0].legend()
    fig.suptitle("Latency percentiles versus h, per precision")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def throughput_vs_concurrency(results: list[LevelResult], path: Path) -> bool:
    """Closed-loop throughput against concurrency, one line per head configuration and precision."""
    closed = [r for r in _measured(results) if r.mode == "closed"]
    if not closed:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, in_series in series(closed).items():
        rows = sorted(in_series, key=lambda r: r.concurrency)
        ax.plot([r.concurrency for r in rows], [r.throughput_rps for r in rows], "o-", label=name)
    ax.set_xscale("log", base=2)
    levels = sorted({r.concurrency for r in closed})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("throughput (requests/s)")
    ax.set_title("Throughput versus concurrency per h and precision")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def latency_throughput(results: list[LevelResult], path: Path) -> bool:
    """p50 and p99 against achieved throughput per h and precision: closed-loop levels by concurrency, open-loop
    levels by rate."""
    measured = _measured(results)
    if not measured:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    by_series = series(measured)
    for ax, key in zip(axes, ("p50", "p99"), strict=True):
        for i, (name, in_series) in enumerate(by_series.items()):
            for mode, style in (("closed", "o-"), ("open", "s:")):
                rows = [r for r in in_series if r.mode == mode]
                rows.sort(key=lambda r: (r.concurrency, r.offered_rate))
                if rows:
                    x, y = [r.throughput_rps for r in rows], [r.latency_ms[key] for r in rows]
                    ax.plot(x, y, style, color=f"C{i % 10}", label=f"{name}, {mode} loop")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel(f"client {key} latency (ms)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency versus throughput per h and precision")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(results: list[LevelResult], out_dir: Path) -> list[str]:
    """Write every plot that has data; returns the file names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("latency_vs_heads.png", latency_vs_heads),
        ("throughput_vs_concurrency.png", throughput_vs_concurrency),
        ("latency_throughput.png", latency_throughput),
    ):
        if draw(results, out_dir / name):
            written.append(name)
    return written
