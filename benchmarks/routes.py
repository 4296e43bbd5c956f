"""`python -m benchmarks.routes`: what routes and shadow traffic cost the clients, in one run.

The default model (d_model 512, h 8) served once, as a user starts it, behind three routes: `plain` (the model
alone), `shadowed` (the same, every request mirrored to h 4) and `split` (90 % to it, 10 % to its int8 variant).
Measured in alternating rounds: c=1 p50 and the c=32 rate (past capacity on 2 cores) of `plain` against `shadowed`,
the shadow's outcomes meanwhile (from the service's /metrics), and the shares of 10,000 requests to `split`, counted
by `mha-serving loadtest` from the answers. Not a test: compare within a run. No torch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.exposition import export_url, scrape
from benchmarks.harness.server import ServerProcess
from benchmarks.models import MODELS, ensure_model, ensure_variant
from benchmarks.serving.requests import request_bodies
from benchmarks.serving.rounds import http_loader, interleaved, joined, load_sides, paired, rounds
from benchmarks.serving.servers import serve_config, started
from loadtest.http_client import post_bytes
from loadtest.server_metrics import parse_counter

SHARES_REQUESTS = 10_000
BARS = {  # the bar: figure -> at most this
    "c=1 p50 shadowed / plain": ("<=", 1.10),
    "c=32 client errors (shadowed)": ("<=", 0),
    "split share error": ("<=", 0.02),
}


def shadow_outcomes(metrics_port: int) -> dict[str, float]:
    """The `shadowed` route's mirrored requests so far, by outcome."""
    text, _ = scrape(export_url(metrics_port), 30)
    return parse_counter(text, "ray_mha_shadow_requests_total", {"route": "shadowed"}, by="outcome")


def settled_outcomes(metrics_port: int, before: dict[str, float], still_s: float = 5.0, timeout_s: float = 60.0):
    """The shadow's outcomes since `before`, once they have stood still `still_s` (the last mirrors run after their
    answers, and Ray exports every few seconds)."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = {k: v - before.get(k, 0.0) for k, v in shadow_outcomes(metrics_port).items()}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s:
            break
        time.sleep(0.5)
    return last


def loadtest(port: int, route: str, *load: str) -> dict:
    """One level of `mha-serving loadtest` (v2 JSON) against `route`, as a user runs it: its report's level."""
    out = Path(tempfile.mkdtemp(prefix="mha-routes-"))
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", f"http://127.0.0.1:{port}", "--models", route]
    cmd += [*load, "--warmup", "0", "--protocol", "v2", "--quiet", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    (level,) = json.loads((out / "report.json").read_text())["levels"]
    return level


def split_shares(port: int, requests: int) -> dict[str, float]:
    """The `split` route at c=32 until `requests` answers: the share per target."""
    level = loadtest(port, "split", "--concurrency", "32", "--max-requests", str(requests), "--duration", "600")
    return {**level["shares"], "requests": level["ok"], "errors": level["errors"]}


def open_loop(server: ServerProcess, rate: float, seconds: float) -> dict[str, dict]:
    """`plain`, then `shadowed`, at `rate` Poisson arrivals a second: latency, errors, and the shadow's outcomes."""
    out = {}
    for route in ("plain", "shadowed"):
        before = shadow_outcomes(server.metrics_port)
        args = ("--rate", f"{rate:g}", "--concurrency", "", "--duration", f"{seconds:g}")
        level = loadtest(server.port, route, *args)
        outcomes = settled_outcomes(server.metrics_port, before)
        out[route] = {"latency_ms": level["latency_ms"], "ok": level["ok"], "errors": level["errors"], **outcomes}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routes", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--seconds", type=float, default=2.5, help="per figure per round (default: 2.5)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the comparison (default: 5)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, default=60.0, help="open-loop requests/s, well under capacity (default: 60)")
    p.add_argument("--open-seconds", type=float, default=20.0, help="seconds of each open-loop run (default: 20)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    args.threads = args.spinning = None
    args.deployment = []
    d, h, layers = MODELS["default"]
    primary = ensure_model(args.models, h, d, layers)
    shadow = ensure_model(args.models, h // 2, d, layers)
    variant = ensure_variant(args.models, primary)
    config = serve_config(args.models, [primary, shadow, variant], "colocated", args)
    config["routes"] = {
        "plain": {"targets": {primary: 1}},
        "shadowed": {"targets": {primary: 1}, "shadow": {"model": shadow, "fraction": 1.0}},
        "split": {"targets": {primary: 90, variant: 10}},
    }
    print(f"{primary} behind routes plain, shadowed (mirrored to {shadow}) and split (90/10 with {variant})...")
    with ServerProcess(config) as server:
        run = started(server, [primary, shadow, variant])
        bodies = request_bodies(64)
        parts = {
            route: load_sides(
                http_loader(server.port, [post_bytes(f"/v2/models/{route}/infer", b) for b in bodies]),
                args.concurrency,
                server,
                route,
            )
            for route in ("plain", "shadowed")
        }
        before = shadow_outcomes(server.metrics_port)
        got = rounds(interleaved(parts), args.rounds, args.seconds)
        for route in parts:
            run[route] = joined(got, route)
        run["shadow outcomes"] = {k: v - before.get(k, 0.0) for k, v in shadow_outcomes(server.metrics_port).items()}
        print(f"{SHARES_REQUESTS} requests to split through mha-serving loadtest...", flush=True)
        run["split"] = split_shares(server.port, SHARES_REQUESTS)
        print(f"plain and shadowed at {args.rate:g} requests/s, open loop, {args.open_seconds:g} s each...", flush=True)
        run["open loop"] = open_loop(server, args.rate, args.open_seconds)
    c1 = paired(run["shadowed"], run["plain"], "c1_p50_ms", "c1_p50_ms", lambda a, b: a / b)
    rate = paired(run["shadowed"], run["plain"], "rate", "rate", lambda a, b: a / b)
    figures = {
        "c=1 p50 shadowed / plain": float(np.median(c1)),
        "c=32 rate shadowed / plain": float(np.median(rate)),
        "c=32 client errors (shadowed)": run["shadowed"]["errors"],
        "split share error": abs(run["split"].get(primary, 0.0) - 0.9),
    }
    print(f"\nc=1 p50 ms: plain {run['plain']['c1_p50_ms']:.2f}, shadowed {run['shadowed']['c1_p50_ms']:.2f}")
    print(f"c={args.concurrency} req/s: plain {run['plain']['rate']:.0f}, shadowed {run['shadowed']['rate']:.0f}")
    print(f"errors: plain {run['plain']['errors']}, shadowed {run['shadowed']['errors']}")
    print(f"shadow outcomes during the rounds: {run['shadow outcomes']}")
    print(f"split: {run['split']}")
    for route, got in run["open loop"].items():
        print(f"open loop at {args.rate:g}/s, {route}: {got}")
    print("\n| figure | rounds | median | bar |\n| --- | --- | ---: | --- |")
    per_round = {"c=1 p50 shadowed / plain": c1, "c=32 rate shadowed / plain": rate}
    for key, value in figures.items():
        bar = BARS.get(key)
        verdict = "" if bar is None else f"{bar[0]} {bar[1]}: {'met' if value <= bar[1] else 'NOT met'}"
        spread = " ".join(f"{x:.2f}" for x in per_round.get(key, []))
        print(f"| {key} | {spread} | {value:.3g} | {verdict} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"runs": run, "figures": figures, "per_round": per_round, "settings": vars(args)}
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
