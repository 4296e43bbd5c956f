"""`python -m benchmarks.cluster_faults`: faults of a real two-node Ray cluster under steady load (issue 28, item 3).
The command line: the models exported if missing, the cluster started, the faults run, the report written."""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import yaml

from benchmarks.cluster_faults.analysis import BACK_WITHIN_S, HOLD_BINS
from benchmarks.cluster_faults.application import faults_config
from benchmarks.cluster_faults.faults import FAULTS, FaultRunError, Run, drive
from benchmarks.cluster_faults.load import LoadPlan
from benchmarks.cluster_faults.report import MACHINE, keep_logs, report
from benchmarks.harness.cluster import LocalCluster, way_in
from benchmarks.models import ensure_model
from contract.metadata import MODEL_FILE

SMALL = re.compile(r"mha-h(\d+)-d(\d+)")  # a model name the benchmarks export on demand (2 layers, 128 tokens)


def ensure_models(models_dir: Path, names: list[str]) -> None:
    """Export each missing `mha-hH-dD` model as the benchmarks' small one (2 layers, 128 tokens; benchmarks/models.py),
    through `mha-serving export` in a subprocess (torch stays out of this process)."""
    for name in names:
        if (models_dir / name / MODEL_FILE).is_file():
            continue
        match = SMALL.fullmatch(name)
        if match is None:
            raise FaultRunError(f"no {name} in {models_dir}, and only mha-hH-dD names are exported on demand")
        heads, d_model = (int(g) for g in match.groups())
        with contextlib.suppress(subprocess.CalledProcessError):  # said below
            ensure_model(models_dir, heads, d_model, layers=2)
        if not (models_dir / name / MODEL_FILE).is_file():
            raise FaultRunError(f"could not export {name} into {models_dir}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster_faults", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument(
        "--model-a", default="mha-h2-d128", help="co-located in the ingress (default: mha-h2-d128, exported if missing)"
    )
    p.add_argument(
        "--model-b",
        default="mha-h4-d128",
        help="in its own deployment, one replica per node (default: mha-h4-d128, exported if missing)",
    )
    p.add_argument("--rate", type=float, default=40.0, help="requests per second, open loop (default: 40)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per attempt (default: 10)")
    p.add_argument("--retries", type=int, default=5, help="retries of a request after its first attempt (default: 5)")
    p.add_argument(
        "--backoff", type=float, default=0.25, help="seconds before the first retry, doubled (default: 0.25)"
    )
    p.add_argument("--settle", type=float, default=10.0, help="seconds of steady load before each fault (default: 10)")
    p.add_argument("--observe", type=float, default=30.0, help="seconds observed after each fault (default: 30)")
    p.add_argument(
        "--recover-timeout", type=float, default=180.0, help="seconds to wait for nothing broken (default: 180)"
    )
    p.add_argument(
        "--step-timeout", type=float, default=240.0, help="seconds for the cluster to come up (default: 240)"
    )
    p.add_argument(
        "--faults",
        help=f"which, in this order (default: {','.join(FAULTS)}; without haproxy where Serve's proxy is the way in)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every Ray node, repeatable (e.g. RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S=2)",
    )
    p.add_argument("--out", type=Path, help="where the report goes (default: runs/cluster-faults/<date-time>/)")
    args = p.parse_args(argv)
    if any("=" not in e for e in args.env):
        p.error("--env takes KEY=VALUE")
    serve_proxy = way_in(dict(e.split("=", 1) for e in args.env)) == "ProxyActor"
    chosen = (
        args.faults if args.faults is not None else ",".join(f for f in FAULTS if f != "haproxy" or not serve_proxy)
    )
    args.faults = [f.strip() for f in chosen.split(",") if f.strip()]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown or not args.faults:
        p.error(f"--faults: choose among {', '.join(FAULTS)}, got {args.faults}")
    if serve_proxy and "haproxy" in args.faults:
        p.error("--faults haproxy needs Serve's HAProxy ingress, which --env RAY_SERVE_ENABLE_HA_PROXY turns off")
    if args.rate <= 0 or args.timeout <= 0 or args.retries < 0 or args.backoff < 0:
        p.error("--rate and --timeout must be above 0, --retries and --backoff at least 0")
    if args.settle < HOLD_BINS or args.observe < BACK_WITHIN_S + HOLD_BINS:
        p.error(f"--settle must be at least {HOLD_BINS} s and --observe at least {BACK_WITHIN_S + HOLD_BINS:g} s")
    if args.model_a == args.model_b:
        p.error("--model-a and --model-b must differ")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs/cluster-faults") / f"{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        ensure_models(args.models, [args.model_a, args.model_b])
    except FaultRunError as exc:
        print(exc, file=sys.stderr)
        return 1
    command = " ".join(["python -m benchmarks.cluster_faults", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.now().isoformat(timespec="seconds")
    root = Path(tempfile.mkdtemp(prefix="rcf", dir="/tmp"))  # short: Ray's socket paths live under it
    cluster = LocalCluster(root, extra_env=dict(e.split("=", 1) for e in args.env))
    config = faults_config(args.models, args.model_a, args.model_b, cluster.http_port, cluster.grpc_port)
    (out / "serve_config.yaml").write_text(yaml.safe_dump(config))
    run = Run(cluster, config, args)
    plan = LoadPlan(
        url=f"http://127.0.0.1:{cluster.http_port}",
        models=tuple(run.models),
        rate=args.rate,
        timeout_s=args.timeout,
        retries=args.retries,
        backoff_s=args.backoff,
        t0=0.0,
        out=out / "requests.csv",
    )
    print(f"{MACHINE}; Ray's files under {root}", flush=True)
    load = (0.0, 0.0)
    try:
        run.start()
        plan = replace(plan, t0=time.monotonic() + 3.0)  # the client's process is started (spawned) meanwhile
        load = drive(run, plan)
    # TimeoutError: a wait for the cluster (polling.until); RuntimeError: a node whose `ray start` kept exiting
    except (FaultRunError, TimeoutError, RuntimeError) as exc:
        run.interrupted = str(exc)
        print(f"cannot go on: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        run.interrupted = "interrupted (Ctrl-C)"
    finally:
        cluster.stop()
        try:
            keep_logs(cluster, out)
        except OSError as exc:
            print(f"could not keep Ray's logs: {exc}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
    if not run.spans:
        print(f"no fault was measured: {run.interrupted or 'the run ended early'}; logs in {out}/logs", file=sys.stderr)
        return 1
    passed = report(run, plan, load, out, command, started)
    print(f"\nwrote {out}/report.md, report.json, requests.csv and logs/")
    return 0 if passed else 1
