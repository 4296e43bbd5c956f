"""A scaling run's report: bare ORT's figures, a row per level, the bar lines; the same as JSON, and a PNG of the
rate against the processes (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from benchmarks.scale.verdict import BarLine

HEADER = (
    "| level | req/s | p50 / p99 ms | / bare | / fewest | c=1 p50 (- bare) | answers per process "
    "| server CPU (machine busy) | clients' CPU (busiest) | GPU |"
)


def _pct(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.0f} %"


def row_line(label: str, row: dict) -> str:
    named = [share for who, share in row["shares"].items() if who]  # gRPC answers name no process
    shares = "/".join(f"{100 * s:.0f}" for s in named) + " %" if named else "n/a"
    cells = [
        label,
        f"{row['rate']:,.0f}",
        f"{row['p50_ms']:.2f} / {row['p99_ms']:.2f}",
        f"{row['over_bare']:.2f}",
        f"{row['over_fewest']:.2f}",
        f"{row['c1_p50_ms']:.2f} ({row['c1_minus_bare_ms']:+.2f})",
        shares,
        f"{row['server_cpu_cores']:.2f} cores (machine {row['machine_busy_pct']:.0f} %)",
        f"{row['client_cpu_cores']:.2f} cores ({row['client_busiest_pct']:.0f} %)",
        _pct(row.get("gpu_busy_pct")),
    ]
    return "| " + " | ".join(cells) + " |"


def table(rows: dict[str, dict]) -> str:
    out = [HEADER, "|" + " --- |" * HEADER.count(" | ") + " --- |"]
    return "\n".join(out + [row_line(label, row) for label, row in rows.items()])


def bare_line(precision: str, bare: dict) -> str:
    scan = bare["scan"]
    return (
        f"bare ORT {precision}: batch-1 p50 {bare['p50_ms']:.2f} ms ({scan['p50_threads']} thread(s)); batched "
        f"{bare['best_rate']:,.0f} seq/s ({scan['best_layout']}, batch {scan['best_batch']})"
    )


def printed(bare: dict[str, dict], rows: dict[str, dict], lines: list[BarLine], facts: dict) -> None:
    print(
        f"\nmedians of {facts['rounds']} rounds of {facts['seconds']:g} s; {facts['cores']} cores, backend "
        f"{facts['backend']}, {facts['protocol']}, {facts['clients']} client processes x {facts['concurrency']} "
        f"connections; ratios are medians of the round-by-round ratios"
    )
    for precision, figures in bare.items():
        print(bare_line(precision, figures))
    print("\n" + table(rows))
    print("round by round:")
    for label, row in rows.items():
        fewest = " ".join(f"{x:.2f}" for x in row["over_fewest_rounds"])
        over_bare = " ".join(f"{x:.2f}" for x in row["over_bare_rounds"])
        print(f"  {label}: / x{row['fewest']} {fewest}; / bare {over_bare}")
    for label, row in rows.items():
        if row["errors"] or row["failure"]:
            print(f"{label}: {row['errors']} answers not 200 or failed; first: {row['failure']}")
        if row["client_busiest_pct"] >= 90:
            print(
                f"{label}: a client process used {row['client_busiest_pct']:.0f} % of its core: the client may be "
                "the limit (add --clients)"
            )
        if len(row["shares"]) > row["processes"]:
            print(f"{label}: {len(row['shares'])} serving processes answered for {row['processes']}: one was replaced")
    print("\nserving process CPU (% of a core, median over the rounds):")
    for label, row in rows.items():
        print(f"  {label}: {', '.join(f'{pct:.0f}' for pct in row['serving_cpu_pct'])}")
    print(
        "\nserving processes' CPU per request by thread, us (all processes, median over the rounds): loop = the event "
        "loop (HTTP, gRPC, handlers); runs = the models' run threads (batch, ORT call, the wait for the GPU); ort = "
        "ORT's and CUDA's threads; other = Ray's and the rest"
    )
    for label, row in rows.items():
        print(f"  {label}: {', '.join(f'{kind} {us:.0f}' for kind, us in row.get('thread_us', {}).items())}")
    if any(row.get("stages") for row in rows.values()):
        print("\none serving process's CPU per request by stage (py-spy; us from the processes' CPU per request):")
        for label, row in rows.items():
            per_request = sum(row.get("thread_us", {}).values())
            stages = sorted(row.get("stages", {}).items(), key=lambda kv: -kv[1])
            print(f"  {label}: {', '.join(f'{stage} {share * per_request:.0f}' for stage, share in stages)}")
    print("\nthe bar:")
    for line in lines:
        print(f"  {line.text}")


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {**report, "bar": [asdict(line) for line in report["bar"]]}
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def plot(path: Path, rows: dict[str, dict]) -> None:
    """Requests/s against serving processes, a line per precision and variant, bare ORT's batched rate dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for precision in dict.fromkeys(row["precision"] for row in rows.values()):
        for variant in dict.fromkeys(r.get("variant", "") for r in rows.values() if r["precision"] == precision):
            mine = [r for r in rows.values() if r["precision"] == precision and r.get("variant", "") == variant]
            served = f"served {precision}" + (f" {variant}" if variant else "")
            line = ax.plot([r["processes"] for r in mine], [r["rate"] for r in mine], "o-", label=served)
        ax.axhline(mine[0]["bare_rate"], ls="--", color=line[0].get_color(), label=f"bare ORT {precision}")
    ax.set_xscale("log", base=2)
    counts = sorted({row["processes"] for row in rows.values()})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.set_xlabel("serving processes")
    ax.set_ylabel("requests/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
