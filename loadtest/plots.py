"""The report's PNG plots (matplotlib, Agg): latency versus h, throughput versus concurrency, latency-throughput;
for decoders, TTFT and ITL per head configuration (generation_latency.png).

Models of the same h at different precisions (an fp32 model and its int8 variant) are separate lines throughout, and
so is each protocol of a run that measured several. A route is a line of its own except against h (it has no one h).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.stats import LevelResult, precision_rank, protocol_rank


def _measured(results: list[LevelResult]) -> list[LevelResult]:
    return [r for r in results if r.latency_ms]


def _several_protocols(results: list[LevelResult]) -> bool:
    return len({r.protocol for r in results}) > 1


def series_name(r: LevelResult, with_protocol: bool = False) -> str:
    return f"h={r.heads} {r.precision}{f' {r.protocol}' if with_protocol else ''} ({r.model})"


def series(results: list[LevelResult]) -> dict[str, list[LevelResult]]:
    """One series per model (and protocol, when there are several), named by its h and precision (and protocol),
    ordered by h, then precision (fp32 first), then protocol."""
    out: dict[str, list[LevelResult]] = {}
    with_protocol = _several_protocols(results)
    for r in sorted(results, key=lambda r: (*r.group_key, r.model)):
        out.setdefault(series_name(r, with_protocol), []).append(r)
    return out


def kinds(results: list[LevelResult]) -> list[tuple[str, str]]:
    """The (precision, protocol) pairs measured: fp32 first, protocols in `--protocol`'s documented order."""
    pairs = {(r.precision, r.protocol) for r in results}
    return sorted(pairs, key=lambda k: (precision_rank(k[0]), k[0], protocol_rank(k[1]), k[1]))


def _told_apart(results: list[LevelResult], with_h: bool = True) -> str:
    """What tells a plot's lines apart, for its title."""
    several = _several_protocols(results)
    if with_h:
        return "h, precision and protocol" if several else "h and precision"
    return "precision and protocol" if several else "precision"


def latency_vs_heads(results: list[LevelResult], path: Path) -> bool:
    """One panel per load level: p50/p90/p99 against the number of heads, a line per percentile and precision (and
    protocol, when there are several)."""
    measured = [r for r in _measured(results) if not r.is_route]
    levels = list(dict.fromkeys(r.level for r in measured))
    lines = kinds(measured)
    with_protocol = _several_protocols(measured)
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
        for k, (precision, protocol) in enumerate(lines):
            rows = [r for r in at_level if (r.precision, r.protocol) == (precision, protocol)]
            rows.sort(key=lambda r: (r.heads, r.model))
            name = f"{precision} {protocol}" if with_protocol else precision
            for i, (key, style) in enumerate((("p50", "o-"), ("p90", "s--"), ("p99", "^:"))):
                x, y = [r.heads for r in rows], [r.latency_ms[key] for r in rows]
                ax.plot(x, y, style, color=f"C{(3 * k + i) % 10}", label=f"{key} {name}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(heads)), [str(h) for h in sorted(set(heads))])
        ax.set_yscale("log")
        ax.set_title(level)
        ax.set_xlabel("heads h")
        ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("client latency (ms)")
    axes[0][0].legend(fontsize=7 if with_protocol else None)
    fig.suptitle(f"Latency percentiles versus h, per {_told_apart(measured, with_h=False)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def throughput_vs_concurrency(results: list[LevelResult], path: Path) -> bool:
    """Closed-loop throughput against concurrency, one line per head configuration and precision (and protocol)."""
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
    ax.set_title(f"Throughput versus concurrency per {_told_apart(closed)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def latency_throughput(results: list[LevelResult], path: Path) -> bool:
    """p50 and p99 against achieved throughput per h and precision (and protocol): closed-loop levels by
    concurrency, open-loop levels by rate."""
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
    fig.suptitle(f"Latency versus throughput per {_told_apart(measured)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def generation_name(r: LevelResult, with_protocol: bool = False) -> str:
    return f"h={r.heads} kv={r.kv_heads}{f' {r.protocol}' if with_protocol else ''} ({r.model})"


def generation_latency(results: list[LevelResult], path: Path) -> bool:
    """A decoder's TTFT and ITL p50/p99 per head configuration (and protocol): bars at one load level, lines
    against concurrency where several closed-loop levels were measured (open-loop levels then left out)."""
    measured = [r for r in results if r.is_generation and r.ok > 0]
    if not measured:
        return False
    with_protocol = _several_protocols(measured)
    closed = [r for r in measured if r.mode == "closed"]
    against_load = len({r.concurrency for r in closed}) > 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        if against_load:
            groups: dict[str, list[LevelResult]] = {}
            for r in sorted(closed, key=lambda r: (r.heads, r.kv_heads, r.model, r.protocol, r.concurrency)):
                groups.setdefault(generation_name(r, with_protocol), []).append(r)
            for i, (name, rows) in enumerate(groups.items()):
                for q, style in (("p50", "o-"), ("p99", "^:")):
                    y = [r.generation[key].get(q, float("nan")) for r in rows]  # type: ignore[union-attr]
                    ax.plot([r.concurrency for r in rows], y, style, color=f"C{i % 10}", label=f"{q} {name}")
            ax.set_xscale("log", base=2)
            levels = sorted({r.concurrency for r in closed})
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("concurrency (closed loop)")
        else:
            names = [f"{generation_name(r, with_protocol)}\n{r.level}" for r in measured]
            x = list(range(len(measured)))
            for offset, q in ((-0.2, "p50"), (0.2, "p99")):
                y = [r.generation[key].get(q, float("nan")) for r in measured]  # type: ignore[union-attr]
                ax.bar([i + offset for i in x], y, width=0.4, label=q)
            ax.set_xticks(x, names, fontsize=7)
        ax.set_ylabel(f"client {title} (ms)")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Generation: TTFT and ITL per head configuration" + (" versus load" if against_load else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(results: list[LevelResult], out_dir: Path) -> list[str]:
    """Write every plot that has data; returns the file names written. A decoder's levels are in the generation
    plot only (their request latency is a whole stream's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = ["generation_latency.png"] if generation_latency(results, out_dir / "generation_latency.png") else []
    results = [r for r in results if not r.is_generation]
    for name, draw in (
        ("latency_vs_heads.png", latency_vs_heads),
        ("throughput_vs_concurrency.png", throughput_vs_concurrency),
        ("latency_throughput.png", latency_throughput),
    ):
        if draw(results, out_dir / name):
            written.append(name)
    return written
