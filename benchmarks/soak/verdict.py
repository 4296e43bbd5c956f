"""The soak run's verdict: issue 28's bar judged from the samples. Windows scale with the run (an hour's are the first
10 minutes after a minute of warm-up, the last 10 and the last 50); each line says what it measured against what.
No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.bar import Line
from benchmarks.soak.sample import KINDS

MEMORY_SLOPE_PER_H = 0.01  # of the starting PSS: the RSS slope's bar
P99_DRIFT = 0.20  # the last window's p99 may be this much above the first's
# "Flat": the last window's median count at most the first window's median plus the larger of (count, share of
# it). Medians, not maxima: descriptors move with the connections open at the moment of a sample (the client keeps up
# to 64 HTTP connections, the ingress closes idle ones after 30 s, early disconnects and slow clients open their
# own), so a burst of latency in one window is no leak; a leak stays and lifts the median.
FD_ALLOWANCE = (5, 0.05)
THREAD_ALLOWANCE = (2, 0.05)


@dataclass(frozen=True)
class Windows:
    """Seconds from the start of the load: warm-up, the first and last windows (each (start, end], a sixth of the
    run) and where the memory slope's fit begins (the last five sixths)."""

    warmup_s: float
    first: tuple[float, float]
    last: tuple[float, float]
    slope_from_s: float

    def has(self, window: tuple[float, float], t: float) -> bool:
        return window[0] < t <= window[1] + 1e-9


def windows(span_s: float) -> Windows:
    sixth = span_s / 6
    warmup = min(60.0, span_s / 12)
    return Windows(warmup, (warmup, warmup + sixth), (span_s - sixth, span_s), sixth)


def slope_per_hour(t_s: Sequence[float], values: Sequence[float]) -> float:
    """The least-squares slope of `values` against time, per hour; nan with fewer than 2 points."""
    t, v = np.asarray(t_s, dtype=float), np.asarray(values, dtype=float)
    if len(t) < 2 or np.ptp(t) == 0:
        return float("nan")
    return float(np.polyfit(t / 3600, v, 1)[0])


def allowed(first_max: float, allowance: tuple[int, float]) -> float:
    count, share = allowance
    return first_max + max(count, share * first_max)


def percentile(samples: list[np.ndarray], q: float) -> float:
    pooled = np.concatenate(samples) if samples else np.array([])
    return float(np.percentile(pooled, q)) if pooled.size else float("nan")


def memory_line(rows: list[dict], w: Windows) -> Line:
    start = next((r for r in rows if r["t_s"] >= w.warmup_s), rows[-1])
    fit = [r for r in rows if r["t_s"] >= w.slope_from_s]
    rss = slope_per_hour([r["t_s"] for r in fit], [r["rss_mib"] for r in fit])
    pss = slope_per_hour([r["t_s"] for r in fit], [r["pss_mib"] for r in fit])
    bar = MEMORY_SLOPE_PER_H * start["pss_mib"]
    return Line(
        "memory slope",
        f"RSS {rss:+.1f} MiB/h (PSS {pss:+.1f} MiB/h) from {w.slope_from_s:g} s on; starting PSS "
        f"{start['pss_mib']:,.0f} MiB",
        f"RSS slope <= {bar:.1f} MiB/h (1 % of the starting PSS per hour)",
        rss <= bar,
    )


def flat_line(rows: list[dict], w: Windows, figure: str, allowance: tuple[int, float]) -> Line:
    first = [r for r in rows if w.has(w.first, r["t_s"])]
    last = [r for r in rows if w.has(w.last, r["t_s"])]
    parts, ok = [], bool(first and last)
    for kind in KINDS:
        key = f"{kind}_{figure}"
        a, b = (float(np.median([r[key] for r in window])) if window else 0.0 for window in (first, last))
        if a == b == 0:
            continue
        grew = b > allowed(a, allowance)
        ok = ok and not grew
        top = max((r[key] for r in last), default=0)
        parts.append(f"{kind} {a:.0f} -> {b:.0f} (max {top:.0f}){' GREW' if grew else ''}")
    count, share = allowance
    return Line(
        f"{figure} flat",
        "median per kind of process, first window -> last: " + ", ".join(parts),
        f"last median <= first median + max({count}, {share:.0%}), every kind",
        ok,
    )


def drift_line(rows: list[dict], latencies: list[dict[str, np.ndarray]], w: Windows) -> Line:
    def pooled(window: tuple[float, float]) -> float:
        return percentile(
            [a for r, lat in zip(rows, latencies, strict=True) if w.has(window, r["t_s"]) for a in lat.values()], 99
        )

    first, last = pooled(w.first), pooled(w.last)
    return Line(
        "p99 drift",
        f"p99 of every valid request: first window {first:.1f} ms, last {last:.1f} ms ({last / first - 1:+.0%})",
        f"last <= first x {1 + P99_DRIFT:g} (a drop is no failure)",
        last <= first * (1 + P99_DRIFT),
    )


def errors_line(totals: dict[str, int]) -> Line:
    server, unanswered = totals.get("5xx", 0), totals.get("unanswered", 0)
    return Line(
        "errors",
        f"{server:,} 5xx, {unanswered:,} unanswered (timeout, closed by the server); "
        f"{totals.get('unexpected', 0):,} other unexpected answers",
        "0 5xx and 0 unanswered",
        server == 0 and unanswered == 0,
    )


def verdict(rows: list[dict], latencies: list[dict[str, np.ndarray]], totals: dict[str, int]) -> list[Line]:
    """Each line of the bar from a run's rows (one per sample, `t_s` ascending, the first at the load's start),
    each row's valid latencies by model (ms; empty for the first) and the run's answers by class."""
    w = windows(rows[-1]["t_s"])
    return [
        memory_line(rows, w),
        flat_line(rows, w, "fds", FD_ALLOWANCE),
        flat_line(rows, w, "threads", THREAD_ALLOWANCE),
        drift_line(rows, latencies, w),
        errors_line(totals),
    ]
