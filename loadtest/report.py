"""Writing and reading a run's report: report.json (everything), report.csv (one row per level), report.md (tables).

A route's level also has its share per target beside the configured weights and, with a shadow, the agreement.
A decoder's level has its streams' TTFT, ITL, TPOT and e2e percentiles, output tokens/s and goodput (a table of its
own), and a generation run writes streams.csv too: a row per successful stream.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from loadtest.agreement import OUTCOMES
from loadtest.stats import LevelResult
from loadtest.workload import DEFAULT_PROTOCOL

REPORT_VERSION = 1
LATENCY_KEYS = ("p50", "p90", "p95", "p99", "max", "mean")
SERVER_KEYS = ("count", "p50", "p90", "p95", "p99")
# precision right after the head configuration, in the order of the service's metric labels (service/metrics.py),
# then how the load was sent: protocol, mode and level
CSV_COLUMNS = (
    ["model", "heads", "head_dim", "d_model", "precision", "protocol", "mode", "level", "concurrency", "offered_rate"]
    + ["achieved_rate", "batch_size", "duration_s", "sent", "ok", "errors_total", "errors", "dropped"]
    + ["throughput_rps", "sequences_per_s"]
    + [f"{k}_ms" for k in LATENCY_KEYS]
    + ["send_lag_p99_ms", "client_cpu_pct", "stopped_by"]
    + [f"server_{k}" + ("" if k == "count" else "_ms") for k in SERVER_KEYS]
    # a route's (empty for a model): weights as configured, answers and their share per model ("model:n;model:n")
    + ["route_weights", "answered_by", "shares"]
    # a route's shadow (n/a where the service exports no agreement)
    + ["shadow_model"]
    + [f"shadow_{o}" for o in OUTCOMES]
    + ["shadow_rows", "shadow_agreeing_rows", "agreement_rate", "max_abs_logit_diff_p50", "max_abs_logit_diff_p99"]
    # a decoder's (empty for a classifier): its streams' figures; its p50_ms.. are the streams' end to end, and its
    # server_* the TTFT histogram's
    + ["kv_heads", "prompt_tokens", "output_tokens", "output_tokens_per_s"]
    + [f"{m}_{q}_ms" for m in ("ttft", "itl", "tpot") for q in ("p50", "p90", "p99")]
    + ["slo_ttft_ms", "slo_itl_ms", "goodput_share", "goodput_rps", "server_itl_count", "server_itl_p50_ms"]
    + ["server_itl_p99_ms"]
)
STREAM_COLUMNS = ["model", "protocol", "level", "prompt_tokens", "output_tokens", "ttft_ms", "itl_max_ms"]
STREAM_COLUMNS += ["itl_mean_ms", "tpot_ms", "e2e_ms", "meets_slo"]
NOT_AVAILABLE = "n/a"


class ReportError(ValueError):
    """A path that does not hold a report.json this tool can read."""


def build_report(meta: dict[str, object], results: list[LevelResult], notes: list[str]) -> dict[str, object]:
    """The report as one JSON-ready dict: run settings and status (`meta`), a record per level, notes."""
    return {"version": REPORT_VERSION, **meta, "levels": [r.to_json() for r in results], "notes": list(notes)}


def csv_row(r: LevelResult) -> dict[str, object]:
    row: dict[str, object] = {k: getattr(r, k) for k in CSV_COLUMNS[:7]}  # model ... mode
    row |= {"level": r.level, "concurrency": r.concurrency, "offered_rate": r.offered_rate}
    row |= {"achieved_rate": round(r.achieved_rate, 3), "batch_size": r.batch_size, "duration_s": r.duration_s}
    row |= {"sent": r.sent, "ok": r.ok, "errors_total": sum(r.errors.values()), "dropped": r.dropped}
    row["errors"] = ";".join(f"{k}:{n}" for k, n in sorted(r.errors.items()))
    row |= {"throughput_rps": r.throughput_rps, "sequences_per_s": r.sequences_per_s}
    row |= {f"{k}_ms": r.latency_ms.get(k, "") for k in LATENCY_KEYS}
    row |= {"send_lag_p99_ms": r.send_lag_p99_ms, "client_cpu_pct": r.client_cpu_pct, "stopped_by": r.stopped_by}
    row |= {f"server_{k}" + ("" if k == "count" else "_ms"): r.server.get(k, "") for k in SERVER_KEYS}
    return row | route_cells(r) | generation_cells(r)


def _server_itl(r: LevelResult) -> dict[str, object]:
    """A decoder's server-side inter-token latency percentiles ({} where not read)."""
    also = r.generation.get("server_also")
    found = [v for k, v in also.items() if "inter_token" in k] if isinstance(also, dict) else []
    return found[0] if found and isinstance(found[0], dict) else {}


def _goodput(r: LevelResult) -> dict[str, object]:
    goodput = r.generation.get("goodput")
    return goodput if isinstance(goodput, dict) else {}


def generation_cells(r: LevelResult) -> dict[str, object]:
    """The generation columns of a level's CSV row (empty for a classifier)."""
    if not r.is_generation:
        return {}
    g = r.generation
    row: dict[str, object] = {"kv_heads": r.kv_heads}
    row |= {k: g.get(k, "") for k in ("prompt_tokens", "output_tokens", "output_tokens_per_s")}
    for m in ("ttft", "itl", "tpot"):
        summary = g.get(f"{m}_ms")
        row |= {f"{m}_{q}_ms": summary.get(q, "") if isinstance(summary, dict) else "" for q in ("p50", "p90", "p99")}
    goodput = _goodput(r)
    row |= {"slo_ttft_ms": goodput.get("slo_ttft_ms", ""), "slo_itl_ms": goodput.get("slo_itl_ms", "")}
    row |= {"goodput_share": goodput.get("share", ""), "goodput_rps": goodput.get("rate_rps", "")}
    itl = _server_itl(r)
    return row | {f"server_itl_{k}" + ("" if k == "count" else "_ms"): itl.get(k, "") for k in ("count", "p50", "p99")}


def _pairs(values: dict[str, object]) -> str:
    return ";".join(f"{k}:{v:g}" if isinstance(v, float) else f"{k}:{v}" for k, v in values.items())


def shadow_cells(shadow: dict[str, object]) -> dict[str, object]:
    """A shadow's numbers by CSV column: n/a each when the service exported none."""
    requests = shadow.get("requests")
    if not isinstance(requests, dict):
        keys = [*(f"shadow_{o}" for o in OUTCOMES), "shadow_rows", "shadow_agreeing_rows", "agreement_rate"]
        return dict.fromkeys([*keys, "max_abs_logit_diff_p50", "max_abs_logit_diff_p99"], NOT_AVAILABLE)
    diff = shadow.get("max_abs_logit_diff") or {}
    agreement = shadow.get("agreement")
    out: dict[str, object] = {f"shadow_{o}": requests.get(o, 0) for o in OUTCOMES}
    out |= {"shadow_rows": shadow.get("rows"), "shadow_agreeing_rows": shadow.get("agreeing_rows")}
    out["agreement_rate"] = NOT_AVAILABLE if agreement is None else agreement
    return out | {f"max_abs_logit_diff_{q}": diff.get(q, NOT_AVAILABLE) for q in ("p50", "p99")}  # type: ignore[union-attr]


def route_cells(r: LevelResult) -> dict[str, object]:
    """The route columns of a level's CSV row (empty for a model, and the shadow's for a route without one)."""
    if not r.is_route:
        return {}
    shares = {model: round(share, 4) for model, share in r.shares.items()}
    row: dict[str, object] = {"route_weights": _pairs(r.targets), "answered_by": _pairs(r.answered_by)}
    row["shares"] = _pairs(shares)
    if r.shadow:
        row |= {"shadow_model": r.shadow.get("model", "")} | shadow_cells(r.shadow)
    return row


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.1f}" if value >= 100 else f"{value:.2f}"
    return "-" if value in ("", None) else str(value).replace("|", "\\|")  # a route's "8|4" is one cell


def _table(headers: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def level_rows(results: list[LevelResult], with_server: bool) -> tuple[list[str], list[list[object]]]:
    """The main table: one row per model, level and protocol, client-side (and server-side) latency side by side."""
    headers = ["model", "h", "precision", "head_dim", "protocol", "level", "ok", "errors", "req/s", "seq/s"]
    headers += ["p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms", "client CPU %"]
    if any(r.mode == "open" for r in results):
        headers += ["offered/s", "achieved/s", "dropped"]
    if with_server:
        headers += ["server n", "server p50 ms", "server p99 ms"]
    rows = []
    for r in results:
        lat = r.latency_ms
        row: list[object] = [r.model, r.heads, r.precision, r.head_dim, r.protocol, r.level, r.ok]
        row.append(sum(r.errors.values()))
        row += [r.throughput_rps, r.sequences_per_s] + [lat.get(k, "") for k in ("p50", "p90", "p95", "p99", "max")]
        row.append(r.client_cpu_pct)
        if "offered/s" in headers:
            row += [r.offered_rate or "", r.achieved_rate, r.dropped] if r.mode == "open" else ["", "", ""]
        if with_server:
            row += [r.server.get("count", ""), r.server.get("p50", ""), r.server.get("p99", "")]
        rows.append(row)
    return headers, rows


def generation_rows(results: list[LevelResult], with_server: bool) -> tuple[list[str], list[list[object]]]:
    """The generation table: one row per decoder, level and protocol: the streams' percentiles (ms), output tokens
    per second and goodput, and the server's own TTFT and ITL beside them."""
    headers = ["model", "h", "kv", "precision", "protocol", "level", "ok", "errors", "req/s", "out tok/s"]
    names = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "e2e"))
    headers += [f"{name} {q}" for _, name in names for q in ("p50", "p90", "p99")]
    headers += ["goodput %", "goodput req/s"]
    if with_server:
        headers += ["server TTFT n", "server TTFT p50", "server TTFT p99", "server ITL p50", "server ITL p99"]
    rows = []
    for r in results:
        g = r.generation
        row: list[object] = [r.model, r.heads, r.kv_heads, r.precision, r.protocol, r.level, r.ok]
        row += [sum(r.errors.values()), r.throughput_rps, g.get("output_tokens_per_s", "")]
        for key, _ in names:
            summary = g.get(key)
            row += [summary.get(q, "") if isinstance(summary, dict) else "" for q in ("p50", "p90", "p99")]
        share = _goodput(r).get("share")
        row += [100 * share if isinstance(share, int | float) else "", _goodput(r).get("rate_rps", "")]
        if with_server:
            itl = _server_itl(r)
            row += [r.server.get("count", ""), r.server.get("p50", ""), r.server.get("p99", "")]
            row += [itl.get("p50", ""), itl.get("p99", "")]
        rows.append(row)
    return headers, rows


def share_rows(results: list[LevelResult]) -> tuple[list[str], list[list[object]]]:
    """A row per route level and model that answered (its targets first): its weight and its share of the answers."""
    headers = ["route", "protocol", "level", "ok", "answered by", "weight %", "share %", "answers"]
    rows = []
    for r in results:
        weights = r.weight_shares
        for model, share in (r.shares or dict.fromkeys(r.targets, math.nan)).items():
            weight = 100 * weights[model] if model in weights else ""
            rows.append([r.model, r.protocol, r.level, r.ok, model, weight, 100 * share, r.answered_by.get(model, 0)])
    return headers, rows


def agreement_rows(results: list[LevelResult]) -> tuple[list[str], list[list[object]]]:
    """A row per level of a route with a shadow: mirrored requests by outcome, rows compared, agreement."""
    headers = ["route", "protocol", "level", "shadow", *OUTCOMES, "rows", "agreeing", "agreement %"]
    headers += ["max logit diff p50", "max logit diff p99", "note"]  # per request: the largest over rows, classes
    rows = []
    for r in results:
        cells = shadow_cells(r.shadow)
        rate = cells["agreement_rate"]
        row = [r.model, r.protocol, r.level, r.shadow.get("model"), *(cells[f"shadow_{o}"] for o in OUTCOMES)]
        row += [cells["shadow_rows"], cells["shadow_agreeing_rows"], 100 * rate if isinstance(rate, float) else rate]
        row += [cells["max_abs_logit_diff_p50"], cells["max_abs_logit_diff_p99"], r.shadow.get("note", "")]
        rows.append(row)
    return headers, rows


def protocol_rows(results: list[LevelResult]) -> tuple[list[str], list[list[object]]]:
    """Each model and level across the protocols it was measured under: p50, p99 and req/s side by side."""
    protocols = list(dict.fromkeys(r.protocol for r in results))
    headers = ["model", "level"] + [f"{p} {k}" for p in protocols for k in ("p50 ms", "p99 ms", "req/s")]
    cells: dict[tuple[str, str], dict[str, LevelResult]] = {}
    for r in results:
        cells.setdefault((r.model, r.level), {})[r.protocol] = r
    rows = []
    for (model, level), by_protocol in cells.items():
        row: list[object] = [model, level]
        for p in protocols:
            r = by_protocol.get(p)
            row += [r.latency_ms.get("p50", ""), r.latency_ms.get("p99", ""), r.throughput_rps] if r else ["", "", ""]
        rows.append(row)
    return headers, rows


def markdown(report: dict[str, object], results: list[LevelResult], plots: list[str]) -> str:
    """report.md: settings, status, the per-level table, errors with an example message, notes, plots."""
    lines = ["# Load test report", ""]
    keys = ("status", "message", "measured", "url", "started_at", "finished_at", "workload", "protocol", "seq_len")
    keys += ("prompt_tokens", "output_tokens", "slo_ttft_ms", "slo_itl_ms")
    for key in keys:
        if report.get(key) not in (None, ""):
            lines.append(f"- {key}: {report[key]}")
    limits = report.get("limits")
    if isinstance(limits, dict):
        lines.append(
            f"- per level: {limits['duration_s']:g} s or {limits['max_requests']} requests, whichever comes first, "
            f"after {limits['warmup_s']:g} s of warm-up; batch size {report.get('batch_size', 1)}; request timeout "
            f"{limits['timeout_s']:g} s; open loop: at most {limits['max_outstanding']} requests in flight"
        )
    machine = report.get("machine")
    if isinstance(machine, dict):
        lines.append(f"- client machine: {machine.get('cpus')} CPUs, {machine.get('platform')}")
    metrics = sorted({str(r.server["metric"]) for r in results if "metric" in r.server})
    if metrics:
        lines.append(f"- server-side latency: histogram {', '.join(metrics)}, observations during each level only")
    generating = [r for r in results if r.is_generation]
    classifying = [r for r in results if not r.is_generation]
    if generating:
        lines += ["", "## Generation per model and load level (ms; a request is good within both SLOs)", ""]
        lines += _table(*generation_rows(generating, with_server=any("count" in r.server for r in generating)))
    if classifying or not results:
        lines += ["", "## Per model and load level", ""]
    if classifying:
        headers, rows = level_rows(classifying, with_server=any("count" in r.server for r in classifying))
        lines += _table(headers, rows)
    elif not results:
        lines.append("Nothing was measured.")
    if len({r.protocol for r in results}) > 1:
        lines += ["", "## Per model and load level, protocols side by side", "", *_table(*protocol_rows(results))]
    routes = [r for r in results if r.is_route]
    if routes:
        lines += ["", "## Routes: share of the answers per model, beside the configured weights", ""]
        lines += _table(*share_rows(routes))
    shadowed = [r for r in routes if r.shadow]
    if shadowed:
        lines += ["", "## Shadow agreement (the service's counters during each level)", ""]
        lines += _table(*agreement_rows(shadowed))
    errors = [
        [r.model, r.protocol, r.level, k, n, r.error_examples.get(k, "")] for r in results for k, n in r.errors.items()
    ]
    if errors:
        lines += ["", "## Errors", "", *_table(["model", "protocol", "level", "status", "count", "example"], errors)]
    if report.get("notes"):
        lines += ["", "## Notes", "", *(f"- {n}" for n in report["notes"])]  # type: ignore[union-attr]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: Path,
    report: dict[str, object],
    results: list[LevelResult],
    plots: list[str],
    streams: list[dict[str, object]] | None = None,
) -> None:
    """Write report.json, report.csv and report.md into out_dir (created if needed), and for a generation run
    streams.csv (a row per successful stream)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if streams:
        with (out_dir / "streams.csv").open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=STREAM_COLUMNS)
            writer.writeheader()
            writer.writerows(streams)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    with (out_dir / "report.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_row(r) for r in results)
    (out_dir / "report.md").write_text(markdown(report, results, plots), encoding="utf-8")


def load_report(path: Path) -> tuple[dict[str, object], list[LevelResult]]:
    """A report from its folder or its report.json, and its levels as LevelResults."""
    file = path / "report.json" if path.is_dir() else path
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: not a readable load-test report ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("levels"), list):
        raise ReportError(f"{file}: has no 'levels' list; is it a report.json written by `mha-serving loadtest`?")
    # a report from before levels had a protocol measured one, the one its run names
    run_protocol = {"protocol": report.get("protocol", DEFAULT_PROTOCOL)}
    return report, [LevelResult.from_json(run_protocol | level) for level in report["levels"]]
