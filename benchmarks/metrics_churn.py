"""`python -m benchmarks.metrics_churn`: Ray's metrics export after 100 replica restarts against a fresh server's.

One `mha-serving serve` with one light model in its own deployment: its export measured fresh (after some traffic),
then the model's replica SIGKILLed again and again (each time Serve replaces it, it answers, it gets traffic and its
series reach the export), then measured again once dead replicas' series have had time to leave. Series count,
the service's own series (`ray_mha_*`), the series a real Prometheus run from deploy/prometheus.yml stores of each
scrape (where the `prometheus` binary is installed), bytes and scrape time, against the bar (within 10 %).
`--lever off` runs the same with Ray's defaults for service/local/ray_env.py's BOUNDED_METRICS_ENV. One table, and
JSON, markdown and a PNG of the series over time in runs/metrics-churn/; exit status 1 when a bar line fails.
Loopback only. No torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path

import httpx

from benchmarks.harness.exposition import export_url, scrape, series
from benchmarks.harness.polling import predicts_ok, until
from benchmarks.harness.prometheus import PrometheusServer
from benchmarks.harness.server import ServerProcess
from contract.metadata import MODEL_FILE
from service.local.ray_env import BOUNDED_METRICS_ENV

BAR = 1.10  # after / fresh, for series count and scrape time (issue 28)
# --lever off: Ray's defaults for the metrics settings of BOUNDED_METRICS_ENV; the router stays on the replica's loop,
# where the local server's throughput-optimized mode runs it anyway.
LEVER_OFF = {
    "RAY_enable_open_telemetry": "1",
    "RAY_metric_cardinality_level": "recommended",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_CONTROLLER_METRICS_INCLUDE_HIGH_CARDINALITY_TAGS": "1",
}
# A worker silent this long has its series dropped (lever on); Ray's default 120 s.
WORKER_TIMEOUT_S = int(os.environ.get("RAY_WORKER_TIMEOUT_S", "120"))
# Ray exports every 10 s by default; every second here (as in the tests), so a new replica's series show within
# seconds and 100 restarts fit in minutes. It does not change which series are kept.
REPORT_INTERVAL_MS = "1000"
MACHINE = f"the server and this client share this machine's {os.cpu_count()} CPUs"
_REPLICA = re.compile(r'^ray_mha_batch_size_count\{[^}]*\breplica="([^"]+)"', re.M)


def counts(text: str) -> dict[str, int]:
    """Series (sample lines) in an exposition, the service's own among them, and its size."""
    lines = series(text)
    return {"series": len(lines), "own": sum(line.startswith("ray_mha_") for line in lines), "bytes": len(text)}


def exported(metrics_port: int) -> dict[str, int]:
    """`counts` of one scrape of the export on `metrics_port`."""
    return counts(scrape(export_url(metrics_port))[0])


def measured(metrics_port: int, scrapes: int, prom: PrometheusServer | None) -> dict:
    """`scrapes` scrapes one after another: the median scrape time, and the last one's counts; with `prom`, the
    series it stored of its first scrape after these."""
    seconds = []
    for _ in range(scrapes):
        text, took = scrape(export_url(metrics_port))
        seconds.append(took)
    names = Counter(re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line[:1] not in "#")
    result = {**counts(text), "scrape_s": statistics.median(seconds), "scrape_s_max": max(seconds), "names": names}
    if prom is not None:
        prom.scraped_since(time.time())
        (stored,) = prom.query("scrape_samples_post_metric_relabeling")
        result["stored"] = int(float(stored["value"][1]))
    return result


def grown(fresh: dict, after: dict, top: int = 6) -> list[tuple[str, int]]:
    """The metric names whose series grew most from `fresh` to `after`, with how many."""
    growth = Counter({name: n - fresh["names"].get(name, 0) for name, n in after["names"].items()})
    return [(name, n) for name, n in growth.most_common(top) if n > 0]


def model_replicas(text: str, model: str) -> set[str]:
    """The `replica` label values of `model`'s own deployment among the engine's batch counts in the export."""
    return {m[1] for m in _REPLICA.finditer(text) if f'deployment="{model}"' in m[0]}


def traffic(port: int, model: str, requests: int) -> int:
    """`requests` predicts to `model`, one after another; how many were answered 200."""
    ok = 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for i in range(requests):
            r = client.post(f"/v1/models/{model}/predict", json={"text": f"churn request {i}"})
            ok += r.status_code == 200
    return ok


def served_and_exported(server: ServerProcess, model: str, requests: int, seen: set[str]) -> str:
    """Once `model` answers: `requests` predicts, then wait until a replica not in `seen` shows in the export (the
    one that answered them); its id."""
    until(f"{model} answering", lambda: predicts_ok(server.port, model), 60, every_s=0.25, retried=())
    traffic(server.port, model, requests)
    new = until(
        "the new replica's series",
        lambda: model_replicas(scrape(export_url(server.metrics_port))[0], model) - seen,
        60,
        every_s=0.25,
        retried=(),  # a failed scrape ends the run
    )
    return sorted(new)[0]


def churn(args, lever: str) -> dict:
    """One server: fresh measure, `args.restarts` SIGKILLs of the model's replica, the measure after."""
    config = {
        "models_dir": str(args.models.resolve()),
        "models": [args.model],
        "backend": "cpu",
        "deployment": {"placement": "deployment", "num_cpus": 0.5},
    }
    env = {
        "RAY_metrics_report_interval_ms": REPORT_INTERVAL_MS,
        **(LEVER_OFF if lever == "off" else BOUNDED_METRICS_ENV),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the server and every Ray process; ray_env's setdefault keeps them
    binary = shutil.which("prometheus")
    if binary is None:
        print("no `prometheus` binary (apt-get install prometheus): the stored-series line is left out")
    try:
        with ServerProcess(config) as server:
            target = f"127.0.0.1:{server.metrics_port}"
            with PrometheusServer(target, "5s", binary) if binary else nullcontext() as prom:
                return _churn(server, prom, args, lever)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _churn(server: ServerProcess, prom: PrometheusServer | None, args, lever: str) -> dict:
    seen = {served_and_exported(server, args.model, args.requests, set())}
    time.sleep(5)  # every process's series reported a few times over
    fresh = measured(server.metrics_port, args.scrapes, prom)
    print(f"[{lever}] fresh: {fresh['series']:,} series ({fresh['own']} ray_mha_*), {fresh['scrape_s'] * 1e3:.0f} ms")
    timeline = [{"restarts": 0, "t_s": 0.0, **exported(server.metrics_port)}]
    start = time.monotonic()
    for i in range(1, args.restarts + 1):
        os.kill(server.replica_pid(args.model), signal.SIGKILL)
        seen.add(served_and_exported(server, args.model, args.requests, seen))
        timeline.append({"restarts": i, "t_s": time.monotonic() - start, **exported(server.metrics_port)})
        if i % 10 == 0:
            print(f"[{lever}] {i} restarts, {timeline[-1]['series']:,} series, {timeline[-1]['t_s']:.0f} s", flush=True)
    right_after = measured(server.metrics_port, args.scrapes, prom)
    settle_end = time.monotonic() + args.settle
    while time.monotonic() < settle_end:  # dead replicas' series leave (lever on) or stay (off)
        time.sleep(5)
        timeline.append({"restarts": args.restarts, "t_s": time.monotonic() - start, **exported(server.metrics_port)})
    traffic(server.port, args.model, args.requests)  # the live replica's series as fresh as at the fresh measure
    time.sleep(5)
    after = measured(server.metrics_port, args.scrapes, prom)
    print(f"[{lever}] after: {after['series']:,} series ({after['own']} ray_mha_*), {after['scrape_s'] * 1e3:.0f} ms")
    return {"fresh": fresh, "right_after": right_after, "after": after, "replicas": len(seen), "timeline": timeline}


def verdicts(run: dict) -> dict[str, bool]:
    fresh, after = run["fresh"], run["after"]
    keys = ("series", "own", "stored", "scrape_s")
    return {key: after[key] <= BAR * fresh[key] for key in keys if key in fresh}


def table(runs: dict[str, dict], restarts: int, settle_s: float) -> str:
    rows = [
        f"| lever | what | fresh | right after {restarts} restarts | {settle_s:g} s later | ratio | bar |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lever, run in runs.items():
        fresh, right, after, ok = run["fresh"], run["right_after"], run["after"], verdicts(run)
        for key, what, fmt in (
            ("series", "series, all", "{:,}"),
            ("own", "series, ray_mha_*", "{:,}"),
            ("stored", "series stored by Prometheus", "{:,}"),
            ("bytes", "bytes", "{:,}"),
            ("scrape_s", "scrape time (median)", "{:.3f} s"),
        ):
            if key not in fresh:  # no Prometheus to store them
                continue
            ratio = after[key] / fresh[key] if fresh[key] else float("nan")
            bar = ("**pass**" if ok[key] else "**fail**") if key in ok else ""
            cells = (fmt.format(fresh[key]), fmt.format(right[key]), fmt.format(after[key]))
            rows.append(
                f"| {lever} | {what} | {' | '.join(cells)} | {ratio:.2f} | {'<= 1.10: ' + bar if bar else ''} |"
            )
    for lever, run in runs.items():
        more = ", ".join(f"{name} +{n}" for name, n in grown(run["fresh"], run["after"]))
        rows.append(f"\nlever {lever}, most grown: {more or 'none'}")
    return "\n".join(rows)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for lever, run in runs.items():
        points = run["timeline"]
        ax.plot([p["t_s"] for p in points], [p["series"] for p in points], label=f"lever {lever}: all series")
        ax.plot([p["t_s"] for p in points], [p["own"] for p in points], "--", label=f"lever {lever}: ray_mha_*")
    ax.set_xlabel("seconds since the first restart (restarts, then the wait)")
    ax.set_ylabel("series in the export")
    ax.set_title("Ray's metrics export through replica restarts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.metrics_churn", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--model", default="mha-h4-d128", help="the model whose replica is killed (default: mha-h4-d128)")
    p.add_argument("--restarts", type=int, default=100, help="replica restarts in a row (default: 100)")
    p.add_argument("--requests", type=int, default=20, help="predicts to each replica (default: 20)")
    p.add_argument("--scrapes", type=int, default=20, help="scrapes per measure, for the median time (default: 20)")
    p.add_argument(
        "--settle",
        type=float,
        default=WORKER_TIMEOUT_S + 15,
        help=f"seconds from the last restart to the measure (default: RAY_WORKER_TIMEOUT_S {WORKER_TIMEOUT_S} + 15)",
    )
    p.add_argument("--lever", choices=("on", "off", "both"), default="on", help="off: Ray's defaults (default: on)")
    p.add_argument("--out", type=Path, default=Path("runs/metrics-churn"), help="where the JSON, markdown and PNG go")
    args = p.parse_args(argv)
    if args.restarts < 1 or args.requests < 1 or args.scrapes < 1 or args.settle < 0:
        p.error("--restarts, --requests and --scrapes must be at least 1, --settle at least 0")
    if not (args.models / args.model / MODEL_FILE).is_file():
        p.error(f"no {args.model} in {args.models} (`python -m benchmarks.serving` exports mha-h4-d128 there)")
    assert LEVER_OFF.keys() == BOUNDED_METRICS_ENV.keys(), "LEVER_OFF must set every key of BOUNDED_METRICS_ENV"
    print(f"{MACHINE}; Ray exports every {REPORT_INTERVAL_MS} ms")
    runs = {lever: churn(args, lever) for lever in (["on", "off"] if args.lever == "both" else [args.lever])}
    text = table(runs, args.restarts, args.settle)
    print(f"\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"metrics-churn-{args.restarts}-{datetime.now():%Y%m%d-%H%M%S}"
    result = {"date": datetime.now().isoformat(timespec="seconds"), "machine": MACHINE, "settings": vars(args)}
    stem.with_suffix(".json").write_text(json.dumps({**result, "runs": runs}, indent=2, default=str) + "\n")
    command = " ".join(["python -m benchmarks.metrics_churn", *(sys.argv[1:] if argv is None else argv)])
    stem.with_suffix(".md").write_text(
        f"# Metrics export churn, {result['date']}\n\n`{command}`; {MACHINE}.\n\n{text}\n"
    )
    plot(runs, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json, .md and .png")
    return 0 if all(all(verdicts(run).values()) for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
