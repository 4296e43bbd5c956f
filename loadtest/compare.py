"""Two reports side by side (A = before, B = after): each model, protocol and level found in both, with ratios B / A
(and a route's shadow agreement, where either report has one)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loadtest.report import load_report
from loadtest.stats import LevelResult

METRICS = ("p50", "p99", "throughput_rps")
ROUTE_METRICS = ("agreement",)  # only where A or B measured one (reports from before routes have none)
# a decoder's, only where A or B measured one: its streams' TTFT and ITL, output tokens/s and goodput share
GENERATION_METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tokens_per_s", "goodput")
OPTIONAL = ROUTE_METRICS + GENERATION_METRICS


@dataclass(frozen=True)
class Comparison:
    """One (model, protocol, level) in both reports: each metric's values in A and B and the ratio B / A."""

    model: str
    heads: int | str  # a route's: its targets', e.g. "8|4"
    precision: str
    protocol: str
    level: str
    values: dict[str, tuple[float, float, float]]  # metric -> (A, B, B / A)


def _value(r: LevelResult, metric: str) -> float:
    if metric == "agreement":
        return r.agreement_rate
    if metric in GENERATION_METRICS:
        return _generation_value(r, metric)
    return r.throughput_rps if metric == "throughput_rps" else r.latency_ms.get(metric, math.nan)


def _generation_value(r: LevelResult, metric: str) -> float:
    g = r.generation
    if metric == "output_tokens_per_s":
        value = g.get(metric)
    elif metric == "goodput":
        value = (g.get("goodput") or {}).get("share")  # type: ignore[union-attr]
    else:
        name, q = metric.split("_")
        value = (g.get(f"{name}_ms") or {}).get(q)  # type: ignore[union-attr]
    return float(value) if isinstance(value, int | float) else math.nan


def ratio(a: float, b: float) -> float:
    """B / A; nan when A is zero or either is missing."""
    if math.isnan(a) or math.isnan(b) or a == 0:
        return math.nan
    return b / a


def compare(a: list[LevelResult], b: list[LevelResult]) -> tuple[list[Comparison], list[str]]:
    """Matched rows (in A's order) and the (model, protocol, level) keys present in only one report."""
    index_b = {(r.model, r.protocol, r.level): r for r in b}
    keys_a = {(r.model, r.protocol, r.level) for r in a}
    rows = []
    for ra in a:
        rb = index_b.get((ra.model, ra.protocol, ra.level))
        if rb is None:
            continue
        values = {}
        for metric in METRICS + OPTIONAL:
            va, vb = _value(ra, metric), _value(rb, metric)
            if metric in METRICS or not (math.isnan(va) and math.isnan(vb)):
                values[metric] = (va, vb, ratio(va, vb))
        rows.append(Comparison(ra.model, ra.heads, ra.precision, ra.protocol, ra.level, values))
    only = [f"only in A: {' '.join(key)}" for key in keys_a - index_b.keys()]
    only += [f"only in B: {' '.join(key)}" for key in index_b.keys() - keys_a]
    return rows, sorted(only)


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


_NAMES = {"throughput_rps": "req/s", "agreement": "agreement %", "output_tokens_per_s": "out tok/s"}
_NAMES |= {"goodput": "goodput %", "ttft_p50": "TTFT p50 ms", "ttft_p99": "TTFT p99 ms"}
_NAMES |= {"itl_p50": "ITL p50 ms", "itl_p99": "ITL p99 ms"}
_SCALE = {"agreement": 100.0, "goodput": 100.0}  # rates, shown in percent


def markdown(rows: list[Comparison], only: list[str], label_a: str, label_b: str) -> str:
    lines = ["# Load test comparison", "", f"- A: {label_a}", f"- B: {label_b}", "- ratio: B / A", ""]
    metrics = [*METRICS, *(m for m in OPTIONAL if any(m in row.values for row in rows))]
    headers = ["model", "h", "precision", "protocol", "level"]
    for metric in metrics:
        name = _NAMES.get(metric, f"{metric} ms")
        headers += [f"A {name}", f"B {name}", f"{metric} B/A"]
    lines += ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for row in rows:
        cells = [row.model, str(row.heads), row.precision, row.protocol, row.level]
        cells = [c.replace("|", "\\|") for c in cells]  # a route's "8|4" is one cell
        for metric in metrics:
            a, b, r = row.values.get(metric, (math.nan, math.nan, math.nan))
            scale = _SCALE.get(metric, 1.0)
            cells += [_fmt(a * scale, 1), _fmt(b * scale, 1), _fmt(r)]
        lines.append("| " + " | ".join(cells) + " |")
    if not rows:
        lines.append("\nNo model, protocol and level is in both reports.")
    lines += [f"- {o}" for o in ([""] if only else []) + only if o]
    return "\n".join(lines) + "\n"


def _json_values(row: Comparison) -> dict[str, list[float | None]]:
    """metric -> [A, B, B / A] with missing values as null (JSON has no NaN)."""
    return {m: [None if math.isnan(x) else x for x in values] for m, values in row.values.items()}


def run_compare(path_a: Path, path_b: Path, out_dir: Path | None) -> str:
    """Load both reports, compare them, write compare.md and compare.json to out_dir if given; returns the Markdown."""
    _, a = load_report(path_a)
    _, b = load_report(path_b)
    rows, only = compare(a, b)
    text = markdown(rows, only, str(path_a), str(path_b))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "compare.md").write_text(text, encoding="utf-8")
        data = [
            {"model": r.model, "heads": r.heads, "precision": r.precision, "protocol": r.protocol, "level": r.level}
            | {"values": _json_values(r)}
            for r in rows
        ]
        (out_dir / "compare.json").write_text(json.dumps({"rows": data, "unmatched": only}, indent=2) + "\n")
    return text
