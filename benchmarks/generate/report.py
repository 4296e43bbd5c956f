"""The generation benchmark's report: per prompt length and concurrency each system's median figures, the service's
ratios to the others (medians of the rounds' own ratios: both sides of a ratio measured seconds apart, on the same
machine state), the service's scaling, and the issue's bar checked against this run's figures. No torch."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable

from benchmarks.serving.rounds import paired

SYSTEMS = {
    "served": "service",
    "before": "service before",  # --versus: another checkout's service, for a change measured before and after
    "bare": "bare loop",
    "genai": "GenAI",
    "plain": "plain server",
}
RATIOS = {
    "before": "service / before",
    "bare": "service / bare loop",
    "genai": "service / GenAI",
    "plain": "service / plain server",
}
BAR_LOADED, BAR_PROMPT = 16, 32  # the issue's bar: 16 concurrent requests of 32-token prompts


def label(system: str, prompt: int, concurrency: int) -> str:
    return f"{system} p={prompt} c={concurrency}"


def _ratio(got: dict, a: str, b: str) -> float:
    """Median over the rounds of a's tokens/s over b's in the same round; nan where either was not measured."""
    if a not in got or b not in got:
        return math.nan
    ratios = paired(got[a], got[b], "tokens_s", "tokens_s", lambda x, y: x / y if y > 0 else math.nan)
    return statistics.median(ratios) if ratios else math.nan


def rows(got: dict, prompts: list[int], concurrency: list[int]) -> list[dict]:
    """One row per prompt length and concurrency: each measured system's medians and the service's ratios."""
    out = []
    for p in prompts:
        for c in concurrency:
            row: dict = {"prompt_tokens": p, "concurrency": c, "systems": {}}
            for system in SYSTEMS:
                if (key := label(system, p, c)) in got:
                    row["systems"][system] = {k: v for k, v in got[key].items() if k != "rounds"}
            row["ratios"] = {s: _ratio(got, label("served", p, c), label(s, p, c)) for s in RATIOS}
            row["served_over_c1"] = _ratio(got, label("served", p, c), label("served", p, 1))
            out.append(row)
    return out


def _figure(got: dict, system: str, prompt: int, concurrency: int, key: str) -> float:
    return got.get(label(system, prompt, concurrency), {}).get(key, math.nan)


def bar_levels(prompts: list[int], concurrency: list[int]) -> tuple[int, int]:
    """The prompt length and loaded concurrency the bar is checked at: the issue's, or this run's nearest."""
    loaded = BAR_LOADED if BAR_LOADED in concurrency else max(concurrency)
    return (BAR_PROMPT if BAR_PROMPT in prompts else min(prompts)), loaded


def bars(got: dict, prompts: list[int], concurrency: list[int]) -> list[dict]:
    """The issue's four bar lines, each with its measured value, its limit and whether this run met it (a value not
    measured is not met)."""
    p, c = bar_levels(prompts, concurrency)
    bare_step = _figure(got, "bare", p, 1, "tpot_p50_ms")
    served, served_1 = label("served", p, c), label("served", p, 1)
    lines = [
        (f"c={c} served tokens/s >= 0.75x bare loop at batch {c}", _ratio(got, served, label("bare", p, c)), 0.75),
        (f"c={c} served tokens/s >= 3x GenAI with {c} generators", _ratio(got, served, label("genai", p, c)), 3.0),
        (f"served tokens/s at c={c} >= 4x at c=1", _ratio(got, served, served_1), 4.0),
    ]
    lines = [(text, value, limit, ">=") for text, value, limit in lines]
    tpot = _figure(got, "served", p, 1, "tpot_p50_ms")
    lines.insert(2, ("c=1 served TPOT p50 <= 1.25x bare batch-1 step + 0.3 ms", tpot, 1.25 * bare_step + 0.3, "<="))
    out = []
    for text, value, limit, op in lines:
        measured = not (math.isnan(value) or math.isnan(limit))
        met = measured and (value >= limit if op == ">=" else value <= limit)
        out.append({"bar": text, "prompt_tokens": p, "value": value, "limit": limit, "op": op, "met": met})
    return out


def _num(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def table(result: dict) -> str:
    """The Markdown report: figures, ratios, and the bar lines."""
    s = result["settings"]
    lines = [
        f"{result['model']}: service and bare loop on {result['backend']}, GenAI on {result['genai_backend']}, "
        f"plain server on {result['backend']}; {s['output_tokens']} output tokens, {s['requests']} requests per "
        f"client per measurement, {s['rounds']} rounds (medians)",
        "",
        "| prompt | c | system | tokens/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | errors |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        for system, f in row["systems"].items():
            cells = [_num(f["tokens_s"])] + [_num(f[k], 2) for k in ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms")]
            lines.append(
                f"| {row['prompt_tokens']} | {row['concurrency']} | {SYSTEMS[system]} | {' | '.join(cells)} | "
                f"{f['errors']} |"
            )
    header = f"| prompt | c | {' | '.join(RATIOS.values())} | service / service c=1 |"
    lines += ["", header, "| ---: |" + " ---: |" * (len(RATIOS) + 2)]
    for row in result["rows"]:
        ratios = [_num(row["ratios"][s], 2) for s in RATIOS] + [_num(row["served_over_c1"], 2)]
        lines.append(f"| {row['prompt_tokens']} | {row['concurrency']} | {' | '.join(ratios)} |")
    p, c = bar_levels(s["prompt_tokens"], s["concurrency"])
    issue = "the issue's: c=16, 32-token prompts, 64 output tokens, d512 h8 kv8 4 layers, 2 cores"
    lines += ["", f"The bar at c={c} and c=1, {p}-token prompts ({issue}):"]
    for bar in result["bars"]:
        verdict = "met" if bar["met"] else "not met"
        lines.append(f"- {bar['bar']}: {_num(bar['value'], 2)} (limit {bar['op']} {_num(bar['limit'], 2)}): {verdict}")
    return "\n".join(lines)


def markdown(heading: str, headers: list[str], rows: list[list[str]]) -> str:
    """A heading line, then a Markdown table of `rows` (cells formatted already) under `headers`."""
    lines = [heading, "", "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def run(
    argv: list[str] | None,
    parse: Callable[[list[str] | None], argparse.Namespace],
    measure: Callable[[argparse.Namespace], dict],
    table: Callable[[dict], str],
) -> int:
    """A generation benchmark from its command line: measured, its Markdown table printed, and with `--json` every
    figure written."""
    args = parse(argv)
    result = measure(args)
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=float) + "\n")
    return 0
