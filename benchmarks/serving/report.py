"""The serving benchmark's bar and report: each ratio of the bar round by round from whichever scenarios ran, and the
tables printed (latency and rate, memory and time to ready, CPU by stage, the ratios against the bar)."""

from __future__ import annotations

import operator

import numpy as np

from benchmarks.serving.precision import PRECISION_RUN
from benchmarks.serving.protocols import GRPC_DIRECT_RUN, GRPC_PROXY_RUN, LARGE_RUN, PROTOCOL_RUN
from benchmarks.serving.rounds import paired
from benchmarks.serving.stages import table

BAR = {
    "small_c32_over_plain": 1.15,  # >=
    "default_c32_over_batched_ort": 0.9,  # >=
    "small_c1_over_bare_ms": 1.0,  # <=
    "default_c1_over_bare_ms": 1.5,  # <=
    "five_c1_p50_over_alone": 1.10,  # <=
    "five_c32_over_alone": 0.90,  # >=
    "five_pss_mib": 1536,  # <=
    "five_ready_s": 15.0,  # <=
    "int8_c32_over_fp32": 2.2,  # >=
    "int8_c1_p50_over_fp32": 0.6,  # <=
    "int8_file_over_fp32": 0.3,  # <=
    "five_int8_pss_over_fp32": 0.7,  # <=
    "grpc_c32_over_http_json": 0.95,  # >=
    # <= : less server CPU per request in binary, on the threads the protocol runs on (the model's runs, the same
    # either way and ~50 x larger, are left out: their noise hides the difference in the total)
    "large_binary_python_cpu_over_json": 1.0,
}


AT_MOST = {
    *("small_c1_over_bare_ms", "default_c1_over_bare_ms", "five_c1_p50_over_alone", "five_pss_mib", "five_ready_s"),
    *("int8_c1_p50_over_fp32", "int8_file_over_fp32", "five_int8_pss_over_fp32"),
    "large_binary_python_cpu_over_json",
}


def per_round(bare: dict, plain: dict | None, runs: dict[str, dict]) -> dict[str, list[float]]:
    """The bar's figures round by round (`rounds`: both sides of each measured in the same round), from whichever
    scenarios ran; the bar takes their medians."""
    out: dict[str, list[float]] = {}
    colocated = runs.get("serve (colocated)")
    if colocated is not None:
        s, d = colocated["small"], colocated["default"]
        if plain is not None:
            out["small_c32_over_plain"] = paired(s, plain, "rate", "rate", operator.truediv)
        out["default_c32_over_batched_ort"] = paired(d, bare["default"], "rate", "best_rate", operator.truediv)
        out["small_c1_over_bare_ms"] = paired(s, bare["small"], "c1_p50_ms", "p50_ms", operator.sub)
        out["default_c1_over_bare_ms"] = paired(d, bare["default"], "c1_p50_ms", "p50_ms", operator.sub)
    for placement, key in (("colocated", "versus"), ("deployment", "versus_deployment")):
        this_run, that_run = runs.get(f"serve ({placement})"), runs.get(f"versus ({placement})")
        if this_run is None or that_run is None:
            continue
        for label in ("small", "default"):
            this, that = this_run[label], that_run[label]
            out[f"{key}_{label}_c32_ratio"] = paired(this, that, "rate", "rate", operator.truediv)
            out[f"{key}_{label}_c1_ms"] = paired(this, that, "c1_p50_ms", "c1_p50_ms", operator.sub)
    alone, five = runs.get("serve (default model alone)"), runs.get("serve (five default models)")
    if alone is not None and five is not None:
        out["five_c1_p50_over_alone"] = paired(
            five["busy"], alone["default"], "c1_p50_ms", "c1_p50_ms", operator.truediv
        )
        out["five_c32_over_alone"] = paired(five["busy"], alone["default"], "rate", "rate", operator.truediv)
        out["five_pss_mib"] = [five["rss_mib"]["Pss"]]
        out["five_ready_s"] = [five["ready_s"]]
    if (both := runs.get(PRECISION_RUN)) is not None:
        fp32, int8 = both["fp32"], both["int8"]
        out["int8_c32_over_fp32"] = paired(int8, fp32, "rate", "rate", operator.truediv)
        out["int8_c1_p50_over_fp32"] = paired(int8, fp32, "c1_p50_ms", "c1_p50_ms", operator.truediv)
        bare_fp32, bare_int8 = both["bare fp32"], both["bare int8"]
        out["int8_bare_b1_p50_over_fp32"] = paired(bare_int8, bare_fp32, "p50_ms", "p50_ms", operator.truediv)
        out["int8_bare_batched_over_fp32"] = paired(bare_int8, bare_fp32, "best_rate", "best_rate", operator.truediv)
        out["int8_file_over_fp32"] = [both["file_bytes"]["int8"] / both["file_bytes"]["fp32"]]
    if (ways := runs.get(PROTOCOL_RUN)) is not None:
        json_, binary_, grpc_ = ways["http json"], ways["http binary"], ways["grpc"]
        out["grpc_c32_over_http_json"] = paired(grpc_, json_, "rate", "rate", operator.truediv)
        out["grpc_c1_minus_http_json_ms"] = paired(grpc_, json_, "c1_p50_ms", "c1_p50_ms", operator.sub)
        out["binary_c32_over_http_json"] = paired(binary_, json_, "rate", "rate", operator.truediv)
        python, native = "server_cpu_python_ms", "server_cpu_native_ms"
        out["grpc_python_cpu_minus_http_json_ms"] = paired(grpc_, json_, python, python, operator.sub)
        out["grpc_native_cpu_minus_http_json_ms"] = paired(grpc_, json_, native, native, operator.sub)
    direct, proxied = runs.get(GRPC_DIRECT_RUN), runs.get(GRPC_PROXY_RUN)
    if direct is not None and proxied is not None:
        grpc_, json_, in_replica = proxied["grpc"], proxied["http json"], direct["grpc"]
        out["proxy_grpc_c32_over_direct"] = paired(grpc_, in_replica, "rate", "rate", operator.truediv)
        out["proxy_grpc_c32_over_proxy_json"] = paired(grpc_, json_, "rate", "rate", operator.truediv)
        out["proxy_grpc_c1_minus_direct_ms"] = paired(grpc_, in_replica, "c1_p50_ms", "c1_p50_ms", operator.sub)
    if (large := runs.get(LARGE_RUN)) is not None:
        json_, binary_ = large["large json"], large["large binary"]
        out["large_binary_cpu_over_json"] = paired(binary_, json_, "server_cpu_ms", "server_cpu_ms", operator.truediv)
        python = "server_cpu_python_ms"
        out["large_binary_python_cpu_over_json"] = paired(binary_, json_, python, python, operator.truediv)
        out["large_binary_c1_over_json"] = paired(binary_, json_, "c1_p50_ms", "c1_p50_ms", operator.truediv)
    five_fp32, five_int8 = runs.get("serve (five default models, fp32)"), runs.get("serve (five default models, int8)")
    if five_fp32 is not None and five_int8 is not None:
        out["five_int8_pss_over_fp32"] = [five_int8["rss_mib"]["Pss"] / five_fp32["rss_mib"]["Pss"]]
    return {key: values for key, values in out.items() if values}  # a figure without rounds: py-spy could not


def report(bare: dict, plain: dict | None, runs: dict[str, dict], figures: dict[str, list[float]], args) -> None:
    concurrency = args.concurrency
    print(f"\n{'server':<34} {'model':<8} {'c=1 p50':>9} {f'c={concurrency}':>11} {'p99':>9}  errors")
    for label in ("small", "default"):
        b = bare[label]
        scan = b["scan"]
        how = f"medians of {len(b['rounds'])} rounds" if "rounds" in b else "the scan"
        line = f"{'bare ORT (b1 p50 / best batch)':<34} {label:<8} {b['p50_ms']:7.2f}ms {b['best_rate']:7.0f} seq/s"
        print(f"{line}  ({scan['p50_threads']} thread(s) / {scan['best_layout']}, batch {scan['best_batch']}; {how})")
    for label in ("fp32", "int8"):
        if (b := runs.get(PRECISION_RUN, {}).get(f"bare {label}")) is not None:
            line = f"{f'bare ORT, default {label}':<34} {'default':<8} {b['p50_ms']:7.2f}ms {b['best_rate']:7.0f} seq/s"
            print(f"{line}  ({b['scan']['best_layout']}, batch {b['scan']['best_batch']})")
    if (files := runs.get(PRECISION_RUN, {}).get("file_bytes")) is not None:
        print(
            f"model.onnx of the default model: fp32 {files['fp32'] / 2**20:.1f} MiB, "
            f"int8 {files['int8'] / 2**20:.1f} MiB"
        )
    if plain is not None:
        print(f"{'plain FastAPI + ORT':<34} {'small':<8} {plain['c1_p50_ms']:7.2f}ms {plain['rate']:7.0f} req/s")
    for run_name, run in runs.items():
        for label, m in run.items():
            if isinstance(m, dict) and "rate" in m:
                print(
                    f"{run_name:<34} {label:<8} {m['c1_p50_ms']:7.2f}ms {m['rate']:7.0f} req/s "
                    f"{m['loaded_p99_ms']:7.1f}ms  {m['errors']}"
                )
    print(f"(served and plain: medians of {args.rounds} rounds of {args.seconds:g} s per figure)")
    print(f"\n{'server':<34} {'ready':>7} {'processes':>9} {'RSS sum':>9} {'PSS sum':>9}")
    for run_name, run in runs.items():
        rss = run["rss_mib"]
        print(f"{run_name:<34} {run['ready_s']:6.1f}s {run['processes']:>9} {rss['Rss']:6.0f}MiB {rss['Pss']:6.0f}MiB")
    for run_name, run in runs.items():
        for label, m in run.items():
            if isinstance(m, dict) and "stages" in m:
                print(f"\n{run_name}, {label} model, c={concurrency}: ingress CPU per request by stage (py-spy)")
                print(table(m["stages"]["shares"], m["stages"]["cpu_ms_per_request"]))
    print("\nratios (bar in brackets; the median of the rounds, each round's figure after it):")
    for key, values in figures.items():
        value = float(np.median(values))
        if key not in BAR:
            what = "this tree against --versus" if key.startswith("versus_") else "no bar"
            print(f"  {key:<36} {value:9.2f}  ({what}) {' '.join(f'{v:.2f}' for v in values)}")
            continue
        sign = "<=" if key in AT_MOST else ">="
        ok = value <= BAR[key] if key in AT_MOST else value >= BAR[key]
        each = " ".join(f"{v:.2f}" for v in values) if len(values) > 1 else ""
        print(f"  {key:<36} {value:9.2f}  [{sign} {BAR[key]:g}] {'ok' if ok else 'NOT MET':<8} {each}")
