"""The soak run's outputs: one row per sample (server side and the client's interval), samples.csv written as the run
goes, a PNG per series over time, and report.md (the verdict, a summary table, latency per model, answers by class).
No torch.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.bar import Line, verdict_table
from benchmarks.soak.load import Tally, classify
from benchmarks.soak.sample import KINDS, PER_KIND
from benchmarks.soak.verdict import Windows, percentile, windows

SERVER = ("rss_mib", "pss_mib", "processes", "server_cpu_pct", "client_cpu_pct", "load_avg_1m")
METRICS = ("metrics_bytes", "metrics_series", "metrics_scrape_s")
CLASSES = ("ok", "expected 4xx", "5xx", "unanswered", "unexpected", "disconnect")
ANSWERS = ("sent", "rate_ok", *(c.replace(" ", "_") for c in CLASSES), "slow_ok", "slow_p50_ms", "dropped", "codes")


def columns(models: list[str]) -> list[str]:
    latency = [f"{m}_{q}" for m in [*models, "all"] for q in ("p50_ms", "p99_ms")]
    return ["t_s", *SERVER, *(f"{k}_{f}" for k in KINDS for f in PER_KIND), *METRICS, *ANSWERS, *latency]


def codes(outcomes: Counter) -> str:
    """Every answer but a 200 and a disconnect, by status or transport error: "400=12 404=6 timeout=1"."""
    by_code: Counter = Counter()
    for (kind, outcome), n in outcomes.items():
        if kind != "disconnect" and outcome != "200":
            by_code[outcome] += n
    return " ".join(f"{code}={n}" for code, n in sorted(by_code.items()))


def classes(outcomes: Counter) -> Counter:
    """Answers counted by what they mean for the verdict (load.classify)."""
    out: Counter = Counter()
    for (kind, outcome), n in outcomes.items():
        out[classify(kind, outcome)] += n
    return out


def client_row(tally: Tally, models: list[str], seconds: float) -> dict:
    """The client's columns of one interval: answers by class and code, p50 / p99 of the valid 200s by model."""
    by_class = classes(tally.outcomes)
    row: dict = {c.replace(" ", "_"): by_class[c] for c in CLASSES}
    valid_ok = tally.outcomes["valid", "200"]
    row.update(sent=sum(tally.outcomes.values()), rate_ok=valid_ok / seconds, dropped=tally.dropped)
    row.update(slow_ok=len(tally.slow_ms), slow_p50_ms=percentile([np.array(tally.slow_ms)], 50))
    row["codes"] = codes(tally.outcomes)
    for model in [*models, "all"]:
        ms = [np.array(v) for m, v in tally.latencies_ms.items() if model in (m, "all")]
        row[f"{model}_p50_ms"], row[f"{model}_p99_ms"] = percentile(ms, 50), percentile(ms, 99)
    return row


class Samples:
    """samples.csv, a row appended (and flushed) per sample, so that a run cut short keeps what it measured."""

    def __init__(self, path: Path, models: list[str]) -> None:
        self._file = open(path, "w", newline="")  # noqa: SIM115 (open for the whole run; `close` closes it)
        self._writer = csv.DictWriter(self._file, columns(models), restval="")
        self._writer.writeheader()

    def add(self, row: dict) -> None:
        self._writer.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _series(rows: list[dict], key: str) -> np.ndarray:
    return np.array([float(r.get(key, math.nan)) if r.get(key, "") != "" else math.nan for r in rows])


# (file, title, panels); a panel is (y label, {line label: column}). "{kind}" and "{model}" expand to each.
FIGURES = (
    (
        "memory.png",
        "RSS and PSS summed over the server's process tree",
        [("MiB", {"RSS": "rss_mib", "PSS": "pss_mib"})],
    ),
    ("memory_by_kind.png", "PSS per kind of process", [("MiB", {"{kind}": "{kind}_pss_mib"})]),
    ("fds.png", "Open file descriptors per kind of process", [("descriptors", {"{kind}": "{kind}_fds"})]),
    ("threads.png", "Threads per kind of process", [("threads", {"{kind}": "{kind}_threads"})]),
    ("latency_p50.png", "p50 of valid requests per model, each interval", [("ms", {"{model}": "{model}_p50_ms"})]),
    ("latency_p99.png", "p99 of valid requests per model, each interval", [("ms", {"{model}": "{model}_p99_ms"})]),
    (
        "answers.png",
        "Answers per interval",
        [
            ("valid 200s / s", {"valid 200s / s": "rate_ok"}),
            ("count", {k: k for k in ("expected_4xx", "5xx", "unanswered", "unexpected", "dropped")}),
        ],
    ),
    (
        "cpu.png",
        "CPU (% of one core): server tree and load client; the machine's load average",
        [("%", {"server": "server_cpu_pct", "client": "client_cpu_pct"}), ("1 min", {"load": "load_avg_1m"})],
    ),
    (
        "metrics.png",
        "Ray's metrics export: one scrape per sample",
        [
            ("bytes", {"size": "metrics_bytes"}),
            ("series", {"series": "metrics_series"}),
            ("s", {"scrape": "metrics_scrape_s"}),
        ],
    ),
)


def _lines(spec: dict[str, str], rows: list[dict], models: list[str]) -> dict[str, str]:
    out = {}
    for label, key in spec.items():
        if "{kind}" in key:
            out.update({k: key.format(kind=k) for k in KINDS if np.nansum(_series(rows, key.format(kind=k))) > 0})
        elif "{model}" in key:
            out.update({m: key.format(model=m) for m in [*models, "all"]})
        else:
            out[label] = key
    return out


def write_figures(rows: list[dict], models: list[str], w: Windows, out: Path) -> list[str]:
    """One PNG per figure of FIGURES, the first and last windows shaded; the file names written."""
    t = _series(rows, "t_s")
    written = []
    for name, title, panels in FIGURES:
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels) + 0.6), sharex=True, squeeze=False)
        for ax, (ylabel, spec) in zip(axes[:, 0], panels, strict=True):
            for label, key in _lines(spec, rows, models).items():
                ax.plot(t, _series(rows, key), ".-", markersize=3, label=label)
            for (a, b), color in ((w.first, "C2"), (w.last, "C3")):
                ax.axvspan(a, b, color=color, alpha=0.08)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
        axes[-1, 0].set_xlabel("seconds of load (shaded: the first and last windows)")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


SUMMARY = (
    ("RSS, tree (MiB)", "rss_mib"),
    ("PSS, tree (MiB)", "pss_mib"),
    *((f"PSS, {k} (MiB)", f"{k}_pss_mib") for k in ("driver", "gcs", "raylet", "ingress")),
    ("descriptors, ingress", "ingress_fds"),
    ("threads, ingress", "ingress_threads"),
    ("processes", "processes"),
    ("valid 200s / s", "rate_ok"),
    ("p50, all models (ms)", "all_p50_ms"),
    ("p99, all models (ms)", "all_p99_ms"),
    ("server CPU (% of a core)", "server_cpu_pct"),
    ("client CPU (% of a core)", "client_cpu_pct"),
    ("machine load average (1 min)", "load_avg_1m"),
    ("/metrics size (bytes)", "metrics_bytes"),
    ("/metrics series", "metrics_series"),
    ("/metrics scrape (s)", "metrics_scrape_s"),
)


def summary_table(rows: list[dict], w: Windows) -> str:
    """start, means of the first and last windows, min, max and end of the main series."""
    out = [
        "| series | start | first window (mean) | last window (mean) | min | max | end |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    t = _series(rows, "t_s")
    first, last = [w.has(w.first, x) for x in t], [w.has(w.last, x) for x in t]
    for label, key in SUMMARY:
        v = _series(rows, key)
        known = v[~np.isnan(v)]
        if not known.size:
            continue
        cells = [
            known[0],
            np.nanmean(v[first]) if any(first) else math.nan,
            np.nanmean(v[last]) if any(last) else math.nan,
        ]
        cells += [known.min(), known.max(), known[-1]]
        out.append(f"| {label} | " + " | ".join(f"{c:,.3g}" if abs(c) < 100 else f"{c:,.0f}" for c in cells) + " |")
    return "\n".join(out)


def latency_table(rows: list[dict], latencies: list[dict[str, np.ndarray]], models: list[str], w: Windows) -> str:
    out = ["| model | first p50 | first p99 | last p50 | last p99 |", "| --- | ---: | ---: | ---: | ---: |"]
    for model in [*models, "all"]:
        cells = []
        for window in (w.first, w.last):
            ms = [
                a
                for r, lat in zip(rows, latencies, strict=True)
                if w.has(window, r["t_s"])
                for m, a in lat.items()
                if model in (m, "all")
            ]
            cells += [percentile(ms, 50), percentile(ms, 99)]
        out.append(f"| {model} | " + " | ".join(f"{c:,.1f} ms" for c in cells) + " |")
    return "\n".join(out)


def answers_text(outcomes: Counter, slow_ms: list[float], dropped: int) -> str:
    by_class = classes(outcomes)
    parts = [f"{c} {by_class[c]:,}" for c in CLASSES]
    slow = f"slow clients answered 200: {len(slow_ms):,} (p50 {percentile([np.array(slow_ms)], 50):.0f} ms)"
    return (
        f"{sum(outcomes.values()):,} answers: {', '.join(parts)}; {slow}; dropped (too many in flight) {dropped:,}. "
        f"By code: {codes(outcomes) or 'none'}."
    )


def thread_names_text(first: dict[str, Counter], last: dict[str, Counter]) -> str:
    """Per kind of process whose threads changed between two snapshots, the thread names whose counts did."""
    out = []
    for kind in KINDS:
        a, b = first.get(kind, Counter()), last.get(kind, Counter())
        changed = sorted(n for n in a.keys() | b.keys() if a[n] != b[n])
        if changed:
            names = ", ".join(f"`{n}` {a[n]} -> {b[n]}" for n in changed)
            out.append(f"- {kind}: {sum(a.values())} -> {sum(b.values())} threads; {names}")
    return "\n".join(out) or "No kind of process changed its threads' names or counts."


def write_report(
    path: Path, head: str, lines: list[Line], rows: list[dict], latencies, models, totals, figures, threads: str
) -> str:
    """report.md: `head` (what ran), the verdict, the summary, latency per model, answers, threads by name, the
    figures."""
    w = windows(rows[-1]["t_s"])
    spans = (
        f"Windows (seconds of load): warm-up {w.warmup_s:g}, first ({w.first[0]:g}, {w.first[1]:g}], last "
        f"({w.last[0]:g}, {w.last[1]:g}], memory slope fitted from {w.slope_from_s:g} s to the end."
    )
    passed = all(x.ok for x in lines)
    text = "\n\n".join(
        [
            head,
            f"## Verdict: {'pass' if passed else 'FAIL'}",
            spans,
            verdict_table(lines),
            "## Summary",
            summary_table(rows, w),
            "## Latency per model (valid requests, pooled over each window, from the scheduled send)",
            latency_table(rows, latencies, models, w),
            "## Answers",
            answers_text(*totals),
            "## Threads by name (once the load started, and at its end)",
            threads,
            "## Figures",
            "\n".join(f"![{f}]({f})" for f in figures),
        ]
    )
    path.write_text(text + "\n")
    return text
