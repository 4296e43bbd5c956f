"""The cluster-faults run's report: report.md (what ran, the verdict, the figures per fault, the timeline),
report.json, the table printed, and the nodes' and Serve's logs kept beside them."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from benchmarks.bar import Line, verdict_table
from benchmarks.cluster_faults.analysis import (
    FULL_SHARE,
    HOLD_BINS,
    PROMPT_S,
    FaultSpan,
    analyse,
    fault_lines,
    read_records,
    steady_line,
    table,
)
from benchmarks.cluster_faults.application import CPU_TEMPLATE, GPU_TEMPLATE, REPLICAS
from benchmarks.cluster_faults.faults import Run
from benchmarks.cluster_faults.load import RETRYABLE, LoadPlan
from benchmarks.harness.cluster import LocalCluster

MACHINE = (
    f"both Ray nodes, the load client (a process of its own) and this driver share this machine's {os.cpu_count()} CPUs"
)


def head_text(command: str, started: str, run: Run, plan: LoadPlan) -> str:
    args = run.args
    a, b = run.models
    way_in = "HAProxy" if run.cluster.proxy_class == "HAProxyManager" else "Serve's proxy"
    text = [
        f"# Cluster faults under load, {started}",
        f"`{command}`; {MACHINE}.",
        f"Two Ray nodes on 127.0.0.1 (`ray start`, {run.cpus:g} CPUs and {run.gpus:g} logical GPU each), "
        f"`serve deploy` of deploy/serve_config.yaml with {a} co-located in the ingress (the settings of "
        f"{CPU_TEMPLATE}) and {b} in its own deployment (those of {GPU_TEMPLATE}, backend auto); {REPLICAS} fixed "
        f"replicas of the ingress and of {b}, one of each per node; the way in ({way_in}) on the head only. Each "
        f"pod's Ray settings (PROXY_LIMITS_ENV, CLUSTER_RAY_ENV), Ray's node health checks every 1 s (3 misses)"
        + (
            f"; extra: {', '.join(f'{k}={v}' for k, v in run.cluster.extra_env.items())}"
            if run.cluster.extra_env
            else ""
        )
        + ".",
        f"Load: an open loop of {plan.rate:g} simple-JSON predicts per second, the two models in turn, through the "
        f"way in; each attempt times out after {plan.timeout_s:g} s; a request is retried up to {plan.retries} times "
        f"(backoff {plan.backoff_s:g} s, doubled each time) on {', '.join(sorted(RETRYABLE))}. Inference is "
        "idempotent: a retry is safe. First-attempt figures are what a client without retries sees, after-retries "
        "figures what a client with these retries sees.",
        f"Each fault: {args.settle:g} s of steady load, the fault, {args.observe:g} s observed, and the wait (up to "
        f"{args.recover_timeout:g} s) until every check passes. The worker node's replacement starts "
        f"{args.observe:g} s after its loss. A fault's span runs from its steady load to the next one's: every "
        "request sent in it counts.",
        f"Definitions: in flight at the fault = first attempts begun before it and not ended (all of them: which "
        f"were on what died is not known, so this bounds it from above). Full rate per second of scheduled send "
        f"times: >= {FULL_SHARE:.0%} of the requests due that second answered 200 at the first attempt within "
        f"{PROMPT_S:g} s; back = the first second from which every second to the span's end (or the replacement "
        f"node's start) is full, at least {HOLD_BINS} of them. Longest gap: no 200 ending at a first attempt, over "
        "the same span. Latency from the scheduled send, requests answered 200 after retries.",
    ]
    if run.interrupted:
        text.append(f"**Cut short: {run.interrupted}.**")
    return "\n\n".join(text)


def timeline_text(spans: list[FaultSpan], t0: float, after: tuple[float, float] | None, end: float) -> str:
    rows = [
        "| fault | what | steady from | fault at | observed to | span ends |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    rows += [
        f"| {s.name} | {s.what} | {s.start - t0:.1f} | {s.at - t0:.1f} | {s.observe_end - t0:.1f} | {s.end - t0:.1f} |"
        for s in spans
    ]
    tail = f"Steady after the faults: {after[0] - t0:.1f} to {after[1] - t0:.1f} s." if after else ""
    return "\n".join(rows) + f"\n\nSeconds from the load's start; the load ended at {end - t0:.1f} s. {tail}"


def report(run: Run, plan: LoadPlan, load: tuple[float, float], out: Path, command: str, started: str) -> bool:
    """report.md and report.json from requests.csv and the timeline; the table and verdict printed; whether every
    line passed."""
    records = read_records(plan.out) if plan.out.is_file() else []
    t0, end = load
    spans = run.spans_with_ends(end)
    results = [analyse(records, s) for s in spans]
    lines: list[Line] = []
    if spans:
        first = spans[0]
        lines.append(steady_line("steady before the faults", records, first.start, first.at))
    for result in results:
        lines += fault_lines(result)
    done = {s.name for s in spans}
    lines += [Line(f"{f}: not run", "", "every fault run", False) for f in run.args.faults if f not in done]
    if run.after:
        lines.append(steady_line("steady after the faults", records, *run.after))
    else:
        lines.append(Line("steady after the faults", "not reached", "every request answered, at the full rate", False))
    passed = bool(records) and all(x.ok for x in lines) and not run.interrupted
    text = "\n\n".join(
        [
            head_text(command, started, run, plan),
            f"## Verdict: {'pass' if passed else 'FAIL'}",
            verdict_table(lines),
            "## Per fault",
            table(results),
            "## Timeline",
            timeline_text(spans, t0, run.after, end),
        ]
    )
    (out / "report.md").write_text(text + "\n")
    result = {
        "started": started,
        "command": command,
        "machine": MACHINE,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(run.args).items()},
        "nodes": {"cpus": run.cpus, "gpus": run.gpus},
        "requests": len(records),
        "faults": [asdict(r) | {"span": asdict(s)} for r, s in zip(results, spans, strict=True)],
        "after": run.after,
        "lines": [asdict(x) for x in lines],
        "passed": passed,
        "interrupted": run.interrupted,
    }
    (out / "report.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\n{table(results)}\n\n{verdict_table(lines)}")
    return passed


def keep_logs(cluster: LocalCluster, out: Path) -> None:
    """The nodes' `ray start` output and Serve's logs (controller, proxy, replicas), into out/logs/."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for log in cluster.root.glob("*.log"):
        shutil.copy(log, logs / log.name)
    for node in cluster.nodes:
        serve = node.temp_dir / "session_latest" / "logs" / "serve"
        if serve.is_dir():
            shutil.copytree(serve, logs / f"{node.name}-serve", dirs_exist_ok=True)
