"""A scaling run's arithmetic: the client processes' outcomes merged into a window's figures, the share of answers
per serving process, and each level's figures against bare ORT and against the fewest processes, round by round."""

from __future__ import annotations

import math
import operator
from collections import Counter

import numpy as np

from benchmarks.scale.levels import Level
from benchmarks.scale.loops import Outcome
from benchmarks.serving.rounds import paired


def percentile_ms(latencies_s: np.ndarray, q: float) -> float:
    return float(np.percentile(latencies_s, q) * 1e3) if latencies_s.size else math.nan


def merged(outcomes: list[Outcome], seconds: float) -> dict:
    """One window's figures from every client process's outcome: requests/s answered 200, their p50 and p99, other
    answers and failures, 200s per serving process, and the clients' CPU: in cores all together, and the busiest
    one's share of its one core (an asyncio client is one thread: near 100 % it is the limit)."""
    latencies = np.concatenate([o.latencies_s for o in outcomes]) if outcomes else np.array([])
    by = sum((o.served_by for o in outcomes), Counter())
    loads = [o.cpu_s / o.wall_s for o in outcomes if o.wall_s > 0]
    return {
        "rate": latencies.size / seconds,
        "p50_ms": percentile_ms(latencies, 50),
        "p99_ms": percentile_ms(latencies, 99),
        "errors": sum(o.errors for o in outcomes),
        "failure": next((o.failure for o in outcomes if o.failure), ""),
        "served_by": dict(by),
        "client_cpu_cores": float(sum(loads)),
        "client_busiest_pct": 100 * max(loads, default=0.0),
    }


def shares(counts: dict[str, int]) -> dict[str, float]:
    """Each serving process's share of the answers, largest first ("" is answers that named none)."""
    total = sum(counts.values())
    return {who: n / total for who, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))} if total else {}


def median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def summary(levels: list[Level], got: dict[str, dict], bare: dict[str, dict]) -> dict[str, dict]:
    """Per level (by label), from the joined c=1 and loaded sides of one `rounds` run (`got`) and bare ORT's per
    precision (`bare`): medians over the rounds; the rate over bare ORT's batched rate and over the same precision's
    fewest processes, and c=1 p50 less bare batch-1 p50, each a median of the round-by-round ratios; the answers'
    shares per serving process over every round; each serving process's CPU (median over the rounds it was in); the
    serving processes' CPU per request by kind of thread, and with --profile one's by stage (medians over the
    rounds)."""
    out = {}
    for level in levels:
        run, ref = got[level.label], bare[level.precision]
        fewest = min(x.processes for x in levels if (x.precision, x.variant) == (level.precision, level.variant))
        base = got[Level(level.precision, fewest, level.variant).label]
        counts = sum((Counter(r.get("served_by", {})) for r in run["rounds"]), Counter())
        per_pid: dict[str, list[float]] = {}
        per_kind: dict[str, list[float]] = {}
        per_stage: dict[str, list[float]] = {}
        for r in run["rounds"]:
            for pid, pct in r.get("serving_cpu_pct", {}).items():
                per_pid.setdefault(pid, []).append(pct)
            for kind, us in r.get("thread_us", {}).items():
                per_kind.setdefault(kind, []).append(us)
            for stage, share in r.get("stages", {}).items():
                per_stage.setdefault(stage, []).append(share)
        keys = ("rate", "p50_ms", "p99_ms", "c1_p50_ms", "errors", "server_cpu_cores", "machine_busy_pct")
        row = {k: run[k] for k in keys if k in run}
        row |= {k: run[k] for k in ("client_cpu_cores", "client_busiest_pct", "gpu_busy_pct") if k in run}
        over_bare = paired(run, ref, "rate", "best_rate", operator.truediv)
        over_fewest = paired(run, base, "rate", "rate", operator.truediv)
        row |= {
            "precision": level.precision,
            "processes": level.processes,
            "variant": level.variant,
            "over_bare": median(over_bare),
            "over_fewest": median(over_fewest),
            "over_fewest_rounds": over_fewest,
            "over_bare_rounds": over_bare,
            "fewest": fewest,
            "c1_minus_bare_ms": median(paired(run, ref, "c1_p50_ms", "p50_ms", operator.sub)),
            "bare_rate": ref["best_rate"],
            "bare_p50_ms": ref["p50_ms"],
            "shares": shares(dict(counts)),
            "serving_cpu_pct": sorted((median(v) for v in per_pid.values()), reverse=True),
            "thread_us": {kind: median(v) for kind, v in per_kind.items()},
            "stages": {stage: median(v) for stage, v in per_stage.items()},
            "failure": next((f for r in run["rounds"] if (f := r.get("failure") or r.get("c1_failure"))), ""),
        }
        out[level.label] = row
    return out


def best(rows: dict[str, dict], precision: str) -> dict | None:
    """The row of `precision` with the highest rate: the level at saturation."""
    mine = [row for row in rows.values() if row["precision"] == precision]
    return max(mine, key=lambda row: row["rate"]) if mine else None


def level_of(row: dict) -> Level:
    return Level(row["precision"], row["processes"], row.get("variant", ""))


def pair_ratio(got: dict[str, dict], a: Level, b: Level) -> float:
    """Level a's rate over level b's, the median of the round-by-round ratios."""
    return median(paired(got[a.label], got[b.label], "rate", "rate", operator.truediv))
