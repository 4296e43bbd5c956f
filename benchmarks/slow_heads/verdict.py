"""The slow-heads run's figures and bar: how the slow connections ended and when, the probe's latency before, during
and after them, the ingress replica's descriptors back to idle; each line judged, and the one table."""

from __future__ import annotations

from collections import Counter

import numpy as np

AFTER_S = 3.0  # the descriptors are counted this long after the last slow connection was closed (the bar's "after")


CLOSED = ("408", "503", "bare close", "reset")  # closed by the server


def latency(samples: list[tuple[float, float | None]]) -> dict:
    """Requests, failures, and p50 / p99 / max in ms of the answered ones."""
    ms = np.array([s for _, s in samples if s is not None]) * 1e3
    out = {"requests": len(samples), "failures": sum(s is None for _, s in samples)}
    for key, value in (("p50_ms", 50), ("p99_ms", 99), ("max_ms", 100)):
        out[key] = float(np.percentile(ms, value)) if len(ms) else float("nan")
    return out


def phases(samples: list[tuple[float, float | None]], begin: float, end: float) -> dict[str, dict]:
    """The probe's latency before the first slow connection, while any was open, and after the last was closed."""
    return {
        "before": latency([s for s in samples if s[0] < begin]),
        "during": latency([s for s in samples if begin <= s[0] <= end]),
        "after": latency([s for s in samples if s[0] > end]),
    }


def probe_ok(phase: dict) -> bool:
    """A phase of the probe within the bar: p99 under 100 ms, and no request failed (a failure has no latency)."""
    return phase["p99_ms"] < 100 and phase["failures"] == 0


def verdicts(result: dict) -> dict[str, bool]:
    """Each line of the bar, from a run's result (the dict `main` writes as JSON)."""
    slow, probe, fds = result["slow"], result["probe"], result["fds"]
    return {
        "closed in time": slow["closed_in_time"] == slow["n"],
        "probe p99 < 100 ms": all(map(probe_ok, probe.values())),
        "fds back to idle": fds["after"] <= fds["idle_max"],
    }


def table(result: dict) -> str:
    """The one table: printed, and the markdown report's body."""
    slow, fds, ok = result["slow"], result["fds"], verdicts(result)
    mark = {True: "**pass**", False: "**FAIL**"}
    outcomes = ", ".join(f"{k}: {v:,}" for k, v in slow["outcomes"].items())
    rows = [
        "| what | measured | bar |",
        "| --- | --- | --- |",
        f"| slow heads closed within header_timeout_s + 1 s ({slow['limit_s']:g} s) | {slow['closed_in_time']:,} of "
        f"{slow['n']:,} ({outcomes}); first byte to close p50 {slow['p50_s']:.2f} s, max {slow['max_s']:.2f} s "
        f"| all: {mark[ok['closed in time']]} |",
    ]
    for phase, p in result["probe"].items():
        rows.append(
            f"| probe {phase} ({p['requests']:,} requests) | p50 {p['p50_ms']:.1f} ms, p99 {p['p99_ms']:.1f} ms, max "
            f"{p['max_ms']:.1f} ms; {p['failures']} failures | p99 < 100 ms, none failed: "
            f"{mark[probe_ok(p)]} |"
        )
    rows.append(
        f"| ingress replica descriptors | idle {fds['idle_min']:,}-{fds['idle_max']:,} (over {fds['idle_s']:g} s), "
        f"peak {fds['peak']:,}, {AFTER_S:g} s after the last close {fds['after']:,} "
        f"| back to idle: {mark[ok['fds back to idle']]} |"
    )
    return "\n".join(rows)


def summarize(run: dict, limit_s: float) -> dict:
    """The slow connections' figures: outcomes, how many closed within `limit_s` of their first byte, times."""
    records = run["records"]
    times = np.array([s for result, _, s in records if result in CLOSED])
    return {
        "n": len(records),
        "limit_s": limit_s,
        "closed_in_time": int(sum(result in CLOSED and s <= limit_s for result, _, s in records)),
        "outcomes": dict(Counter(result for result, _, _ in records)),
        "p50_s": float(np.median(times)) if len(times) else float("nan"),
        "max_s": float(times.max()) if len(times) else float("nan"),
        "each": [(result, round(s, 4)) for result, _, s in records],  # outcome, first byte to close (s)
    }
