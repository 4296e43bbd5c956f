"""`python -m benchmarks.serving`: the service against bare ONNX Runtime and a plain FastAPI + ORT server, in one run:
the command line, the scenarios asked for in turn, the report and the JSON."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from benchmarks.models import MODELS, ensure_model
from benchmarks.serving.bare import bare_scan
from benchmarks.serving.placements import deployment, five_models, side_by_side
from benchmarks.serving.precision import precisions
from benchmarks.serving.protocols import grpc_proxy, large_requests, protocol_cpu, protocols
from benchmarks.serving.report import per_round, report
from benchmarks.serving.requests import TOKENS
from contract.settings import DEFAULT_HEADS
from service.runtime import SPINNING


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--seconds", type=float, default=2.5, help="per figure per round (default: 2.5)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every comparison (default: 5)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", type=int, help="ORT intra-op threads per model (default: the server's)")
    p.add_argument("--spinning", choices=SPINNING, help="ORT intra-op threads' spinning (default: the server's)")
    p.add_argument("--proxy", action="store_true", help="through Serve's proxy instead of direct ingress")
    p.add_argument("--profile", action="store_true", help="py-spy the ingress under load: CPU per request by stage")
    p.add_argument(
        "--scenarios",
        type=lambda v: set(v.split(",")),
        default={"plain", "colocated", "deployment", "five", "int8", "protocols"},
        help="which servers to measure besides bare ORT (default: plain,colocated,deployment,five,int8,protocols; "
        "also grpc-proxy: gRPC and HTTP JSON in the replica against through Serve's proxies)",
    )
    p.add_argument(
        "--versus",
        type=Path,
        metavar="TREE",
        help="also serve from another checkout (e.g. `git worktree add /tmp/before <commit>`), colocated and in "
        "deployments as those scenarios run, measured in the same rounds: this code's c=1 p50 and c=32 rate against "
        "that one's",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for the servers (levers)")
    p.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model setting for every served model (AppConfig `deployment`), e.g. max_concurrent_batches=2",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    names = {label: ensure_model(args.models, h, d, layers) for label, (d, h, layers) in MODELS.items()}
    five = [ensure_model(args.models, h, 512, 4) for h in DEFAULT_HEADS]  # what `make run` serves
    print(f"bare ORT ({TOKENS} tokens per sequence): which thread count, layout and batch size...", flush=True)
    scans = {label: bare_scan(args.models, name, args.seconds) for label, name in names.items()}
    bare = {
        label: {"scan": scan, "p50_ms": scan["p50_ms"], "best_rate": scan["best_rate"]} for label, scan in scans.items()
    }
    plain, runs = side_by_side(args, names, scans, bare)
    if "deployment" in args.scenarios:
        runs.update(deployment(args, names))
    if "five" in args.scenarios:
        runs.update(five_models(args, names, five))
    if "int8" in args.scenarios:
        runs.update(precisions(args, names["default"], scans["default"], five))
    if "protocols" in args.scenarios:
        runs.update(protocols(args, names["default"]))
        runs.update(large_requests(args))
    if "grpc-proxy" in args.scenarios:
        runs.update(grpc_proxy(args, names["default"]))
    figures = per_round(bare, plain, runs)
    report(bare, plain, runs, figures, args)
    protocol_cpu(runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {key: float(np.median(values)) for key, values in figures.items()}
        out = {
            "bare": bare,
            "plain": plain,
            "runs": runs,
            "ratios": summary,
            "per_round": figures,
            "settings": vars(args),
        }
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0
